"""Reading an adapter's two files with bounds: whatever they hold, the readers raise nothing
but ``AdapterError`` (naming the file) and never read more than a fixed number of bytes.

Both the front (before anything reaches the engine core) and the core (before it accepts
an adapter) read them this way. Bounds: the config and the safetensors header are at most a
few MiB, JSON nests at most ``MAX_JSON_DEPTH`` levels (the standard decoder recurses and
would raise ``RecursionError``), a number has at most ``MAX_NUMBER_CHARS`` characters (an
integer of thousands of digits raises ``ValueError`` in ``int``, and ``float`` of a huge one
raises ``OverflowError``), no ``NaN`` / ``Infinity``, no duplicate keys. Only regular files
are opened (never a FIFO or a device, which could block or never end), without following a
descriptor's change of type between the check and the read. The safetensors header is
checked the way ``safe_open`` checks it (dtype, shape, contiguous ``data_offsets`` that end
where the file ends), so a worker that later reads the tensors cannot fail on it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from tokenwire.runtime.errors import AdapterError

MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 8 << 20  # safetensors itself allows 100 MB; a LoRA header is kilobytes
MAX_JSON_DEPTH = 32
MAX_NUMBER_CHARS = 40
MAX_TENSORS = 1 << 16
MAX_TENSOR_NAME_CHARS = 512
MAX_DIMS = 8
MAX_DIM = 1 << 31
# The dtypes an adapter's tensors may have (read as float32 by the workers).
DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
# A JSON string (or an unterminated one, to the end): possessive, so it never backtracks.
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class _Refused(Exception):
    """A JSON value out of bounds (raised inside the decoder's hooks)."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


# ---------------------------------------------------------------------------- JSON
def json_depth(text: str) -> int:
    """How deep ``text`` nests arrays and objects (exact for valid JSON, and for the valid
    prefix of invalid JSON, which is as far as a decoder gets)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise _Refused(f"holds a number longer than {MAX_NUMBER_CHARS} characters")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise _Refused(f"holds a number longer than {MAX_NUMBER_CHARS} characters")
    value = float(text)
    if not math.isfinite(value):
        raise _Refused("holds a number out of the range of a float")
    return value


def _constant(text: str) -> Any:
    raise _Refused(f"holds {text}, which is not a JSON number")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Refused("holds an object with a duplicate key")
    return out


def parse_json(data: bytes, what: str) -> Any:
    """Decode JSON within the bounds above; ``AdapterError(what, ...)`` otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise AdapterError(what, "is not UTF-8 text") from None
    if json_depth(text) > MAX_JSON_DEPTH:
        raise AdapterError(what, f"nests JSON deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(
            text,
            parse_int=_int,
            parse_float=_float,
            parse_constant=_constant,
            object_pairs_hook=_unique,
        )
    except _Refused as exc:
        raise AdapterError(what, str(exc)) from None
    except (ValueError, RecursionError):
        raise AdapterError(what, "is not valid JSON") from None


# ---------------------------------------------------------------------------- files
@contextlib.contextmanager
def open_regular(path: Path, what: str) -> Iterator[tuple[int, int]]:
    """(descriptor, size) of a regular file; a missing one names ``lora_path``."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise AdapterError("lora_path", f"has no {what}") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise AdapterError(what, f"cannot be opened ({type(exc).__name__})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AdapterError(what, "is not a regular file")
        yield fd, info.st_size
    finally:
        os.close(fd)


def read_exactly(fd: int, offset: int, size: int, what: str) -> bytes:
    chunks, got = [], 0
    while got < size:
        try:
            chunk = os.pread(fd, size - got, offset + got)
        except OSError as exc:
            raise AdapterError(what, f"cannot be read ({type(exc).__name__})") from None
        if not chunk:
            raise AdapterError(what, "ended early (it changed while being read?)")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_json_file(path: Path, what: str, limit: int = MAX_CONFIG_BYTES) -> Any:
    with open_regular(path, what) as (fd, size):
        if size > limit:
            raise AdapterError(what, f"is larger than {limit} bytes")
        return parse_json(read_exactly(fd, 0, size, what), what)


# ---------------------------------------------------------------------------- safetensors
def read_safetensors_header(path: Path, what: str) -> dict[str, TensorInfo]:
    """Tensor name -> dtype and shape, from a header checked as ``safe_open`` checks it."""
    with open_regular(path, what) as (fd, size):
        if size < 8:
            raise AdapterError(what, "is too short for a safetensors file")
        length = int.from_bytes(read_exactly(fd, 0, 8, what), "little")
        if length > MAX_HEADER_BYTES:
            raise AdapterError(what, f"has a header larger than {MAX_HEADER_BYTES} bytes")
        if length < 2 or length > size - 8:
            raise AdapterError(what, "has a header size that does not fit the file")
        raw = read_exactly(fd, 8, length, what)
    if not raw.startswith(b"{"):
        raise AdapterError(what, "has a header that is not a JSON object")
    header = parse_json(raw, f"{what} header")
    if not isinstance(header, dict):
        raise AdapterError(what, "has a header that is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise AdapterError(what, "has __metadata__ that is not an object of strings")
    if len(header) > MAX_TENSORS:
        raise AdapterError(what, f"holds more than {MAX_TENSORS} tensors")
    spans = {name: _tensor_entry(name, entry, what) for name, entry in header.items()}
    _check_offsets(spans, size - 8 - length, what)
    return {name: info for name, (info, _) in spans.items()}


def _tensor_entry(name: str, entry: Any, what: str) -> tuple[TensorInfo, tuple[int, int]]:
    if len(name) > MAX_TENSOR_NAME_CHARS:
        raise AdapterError(what, f"has a tensor name longer than {MAX_TENSOR_NAME_CHARS}")
    shown = name if name.isprintable() else ascii(name)
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise AdapterError(what, f"tensor {shown!r} needs exactly dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        raise AdapterError(
            what, f"tensor {shown!r} has dtype {str(dtype)[:16]!r}; supported: {list(DTYPE_BYTES)}"
        )
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_DIMS
        and all(_is_count(d) and d <= MAX_DIM for d in shape)
    ):
        raise AdapterError(what, f"tensor {shown!r} has an invalid shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise AdapterError(what, f"tensor {shown!r} has invalid data_offsets")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise AdapterError(what, f"tensor {shown!r} has data_offsets that do not fit its shape")
    return TensorInfo(dtype, tuple(shape)), (begin, end)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_offsets(
    spans: dict[str, tuple[TensorInfo, tuple[int, int]]], data_bytes: int, what: str
) -> None:
    """The tensors' data must tile the buffer after the header exactly (``safe_open``)."""
    position = 0
    for begin, end in sorted(span for _, span in spans.values()):
        if begin != position or end < begin:
            raise AdapterError(what, "has tensors whose data_offsets overlap or leave gaps")
        position = end
    if position != data_bytes:
        raise AdapterError(what, "holds data that does not match its header (truncated?)")
