"""The GGUF container: header, scalar metadata and the tensor table, parsed fast.

``gguf.GGUFReader`` builds a numpy view per element of every metadata array, which takes
~4.5 s on SmolLM2's 49k-token vocabulary and merges; this parser only walks over arrays
(tokenizer data is not needed to read weights) and keeps scalar and string values, so the
header of the default model parses in milliseconds. The tensor bytes are memory-mapped.

Layout (little-endian, GGUF v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count; metadata entries (string key, u32 value type, value); tensor infos (string name, u32
n_dims, u64 dims (innermost first), u32 ggml type, u64 offset); padding to
``general.alignment`` (default 32); tensor data at those offsets.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format of a scalar; 8 = string, 9 = array.
_SCALAR: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_NUMPY_TYPES: dict[GGMLQuantizationType, str] = {
    GGMLQuantizationType.F32: "<f4",
    GGMLQuantizationType.F16: "<f2",
    GGMLQuantizationType.F64: "<f8",
    GGMLQuantizationType.I8: "<i1",
    GGMLQuantizationType.I16: "<i2",
    GGMLQuantizationType.I32: "<i4",
    GGMLQuantizationType.I64: "<i8",
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: ``shape`` in numpy order (outermost first), element counts."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: scalar/string metadata (arrays omitted) and its tensors."""

    metadata: Mapping[str, Any]
    tensors: tuple[TensorInfo, ...]
    data: np.memmap[Any, np.dtype[np.uint8]]

    def tensor_data(self, info: TensorInfo) -> npt.NDArray[Any]:
        """The tensor's bytes as numpy: float/int types in their dtype and ``info.shape``;
        quantized types as uint8 rows [..., row_bytes] of whole blocks (read-only view)."""
        raw = self.data[info.offset : info.offset + info.nbytes]
        dtype = _NUMPY_TYPES.get(info.ggml_type)
        if dtype is not None:
            return raw.view(dtype).reshape(info.shape)
        block, size = GGML_QUANT_SIZES[info.ggml_type]
        return raw.reshape(*info.shape[:-1], info.shape[-1] // block * size)


class _Cursor:
    """Sequential little-endian reads from a buffer; ValueError past its end."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError("GGUF header runs past the end of the file (truncated?)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("GGUF header runs past the end of the file (truncated?)")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        """A scalar or string value; an array is skipped and returns None."""
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            self._skip_array()
            return None
        raise ValueError(f"GGUF metadata value type {vtype} is unknown (damaged header?)")

    def _skip_array(self) -> None:
        etype, count = self.unpack("<I"), self.unpack("<Q")
        if etype in _SCALAR:
            self.pos += count * struct.calcsize(_SCALAR[etype])
            if self.pos > len(self.buf):
                raise ValueError("GGUF header runs past the end of the file (truncated?)")
            return
        if etype == _STRING:  # the tokenizer's vocabulary and merges: skip, don't decode
            buf, pos, end = self.buf, self.pos, len(self.buf)
            for _ in range(count):
                if pos + 8 > end:
                    break
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            if pos > end:
                raise ValueError("GGUF header runs past the end of the file (truncated?)")
            self.pos = pos
            return
        for _ in range(count):
            self.value(etype)


def open_gguf(path: Path) -> GGUFFile:
    """Parse ``path``'s header and tensor table; ValueError on a malformed or truncated file."""
    data: np.memmap[Any, np.dtype[np.uint8]] = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data))  # type: ignore[arg-type]
    if bytes(data[:4]) != _MAGIC:
        raise ValueError(f"{path.name} is not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in _VERSIONS:
        raise ValueError(f"{path.name}: GGUF version {version} is not supported (big-endian?)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    entries = [_tensor_entry(cur) for _ in range(n_tensors)]
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-cur.pos // alignment) * alignment
    tensors = tuple(_tensor_info(e, start, len(data)) for e in entries)
    return GGUFFile(metadata, tensors, data)


def _tensor_entry(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
    return name, dims, cur.unpack("<I"), cur.unpack("<Q")


def _tensor_info(
    entry: tuple[str, tuple[int, ...], int, int], start: int, file_size: int
) -> TensorInfo:
    name, dims, raw_type, offset = entry
    try:
        ggml_type = GGMLQuantizationType(raw_type)
    except ValueError:
        raise ValueError(f"GGUF tensor {name!r}: unknown ggml type {raw_type}") from None
    block, size = GGML_QUANT_SIZES[ggml_type]
    if not dims or dims[0] % block:
        raise ValueError(
            f"GGUF tensor {name!r} ({ggml_type.name}): dims {dims} do not split into "
            f"blocks of {block}"
        )
    nbytes = int(np.prod(dims, dtype=np.int64)) // block * size
    if start + offset + nbytes > file_size:
        raise ValueError(f"GGUF tensor {name!r}: data runs past the end of the file (truncated?)")
    return TensorInfo(name, ggml_type, tuple(reversed(dims)), start + offset, nbytes)
