"""The bounded readers of an adapter's files (``runtime/lora/files.py``, ``checks.py``):
whatever the bytes, they raise ``AdapterError`` naming the file and nothing else, read only
regular files, and check a safetensors header the way ``safe_open`` does, so every header
they accept opens (and every tensor reads) in ``safetensors`` too."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokenwire.runtime.errors import AdapterError
from tokenwire.runtime.lora.checks import read_adapter
from tokenwire.runtime.lora.files import (
    MAX_JSON_DEPTH,
    json_depth,
    parse_json,
    read_json_file,
    read_safetensors_header,
)

WEIGHTS = "adapter_model.safetensors"
A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def raw_file(path: Path, header: dict[str, Any] | str, data: bytes = b"") -> Path:
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def adapter_dir(tmp_path: Path, config: dict[str, Any] | None = None) -> Path:
    folder = tmp_path / "adapter"
    folder.mkdir()
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    save_file({A_KEY: torch.ones(2, 8), B_KEY: torch.ones(8, 2)}, str(folder / WEIGHTS))
    return folder


# ---------------------------------------------------------------------------- JSON
@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("{}", 1),
        ('{"a": [1, {"b": []}]}', 4),
        ('{"a": "[[[[{{{{"}', 1),  # brackets inside strings do not nest
        ('{"a": "\\"[[[["}', 1),  # nor after an escaped quote
        ('["\\\\", [["x"]]]', 3),  # an escaped backslash ends before the quote
        ("1", 0),
    ],
)
def test_json_depth_is_exact(text: str, depth: int) -> None:
    assert json_depth(text) == depth
    parsed = json.loads(text)  # the same document the depth was measured on
    assert parse_json(text.encode(), "x") == parsed


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("[" * 5000 + "]" * 5000, "deeper than"),
        ("[" * 100000, "deeper than"),  # unterminated: the decoder would still recurse
        ('{"r": ' + "1" * 5000 + "}", "longer than"),
        ('{"r": 1' + "0" * 400 + ".5}", "longer than"),
        ('{"r": 1e999}', "range of a float"),
        ('{"r": -Infinity}', "not a JSON number"),
        ('{"r": NaN}', "not a JSON number"),
        ('{"r": 1, "r": 2}', "duplicate key"),
        ('{"r": ', "not valid JSON"),
        ('"\\ud800', "not valid JSON"),
    ],
)
def test_hostile_json_is_an_adapter_error(text: str, phrase: str) -> None:
    with pytest.raises(AdapterError, match=phrase) as caught:
        parse_json(text.encode(), "adapter_config.json")
    assert caught.value.param == "adapter_config.json"


def test_json_depth_stays_linear_on_hostile_strings() -> None:
    """Unterminated strings full of escapes are where a backtracking scanner goes
    quadratic; the bound is generous, the point is that it is not minutes."""
    for text in ('"\\"' * 300_000, '"' + "\\" * 600_000, '["' * 300_000):
        started = time.monotonic()
        with pytest.raises(AdapterError):
            parse_json(text.encode(), "x")
        assert time.monotonic() - started < 10.0


def test_json_depth_limit_is_inclusive() -> None:
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json(ok.encode(), "x") is not None
    with pytest.raises(AdapterError, match="deeper"):
        parse_json(("[" + ok + "]").encode(), "x")


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    fifo = tmp_path / "adapter_config.json"
    os.mkfifo(fifo)  # opening it for reading would block until a writer comes
    with pytest.raises(AdapterError, match="not a regular file"):
        read_json_file(fifo, "adapter_config.json")
    with pytest.raises(AdapterError, match="not a regular file"):
        read_json_file(tmp_path, "adapter_config.json")
    with pytest.raises(AdapterError, match=r"has no adapter_config\.json") as caught:
        read_json_file(tmp_path / "absent", "adapter_config.json")
    assert caught.value.param == "lora_path"


# ---------------------------------------------------------------------------- safetensors
def test_a_real_header_reads_like_safe_open(tmp_path: Path) -> None:
    path = tmp_path / WEIGHTS
    save_file(
        {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)},
        str(path),
        metadata={"format": "pt"},
    )
    header = read_safetensors_header(path, WEIGHTS)
    with safe_open(str(path), framework="pt") as f:
        assert {k: list(v.shape) for k, v in header.items()} == {
            k: f.get_slice(k).get_shape() for k in list(f.keys())
        }
    assert {k: v.dtype for k, v in header.items()} == {"a": "F32", "b": "BF16"}


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    ("header", "data", "phrase"),
    [
        ({"t": _entry("F32", [2], 0, 8)}, b"\0" * 4, "does not match its header"),
        ({"t": _entry("F32", [2], 0, 8)}, b"\0" * 12, "does not match its header"),
        ({"t": _entry("F32", [3], 0, 8)}, b"\0" * 8, "do not fit its shape"),
        ({"t": _entry("I64", [1], 0, 8)}, b"\0" * 8, "dtype"),
        ({"t": _entry("F32", [-1], 0, 4)}, b"\0" * 4, "invalid shape"),
        ({"t": _entry("F32", [True], 0, 4)}, b"\0" * 4, "invalid shape"),
        ({"t": _entry("F32", [1], 4, 8)}, b"\0" * 8, "overlap or leave gaps"),
        (
            {"t": _entry("F32", [1], 0, 4), "u": _entry("F32", [1], 0, 4)},
            b"\0" * 4,
            "overlap or leave gaps",
        ),
        ({"t": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "needs exactly"),
        ({"__metadata__": {"k": 1}}, b"", "__metadata__"),
        ("[]", b"", "not a JSON object"),
        ('{"t": ' + "[" * 1000 + "]" * 1000 + "}", b"", "deeper"),
    ],
)
def test_bad_headers_are_adapter_errors(
    tmp_path: Path, header: dict[str, Any] | str, data: bytes, phrase: str
) -> None:
    path = raw_file(tmp_path / WEIGHTS, header, data)
    with pytest.raises(AdapterError, match=phrase):
        read_safetensors_header(path, WEIGHTS)
    # safetensors refuses the same files (an I64 tensor is fine there, not for an adapter).
    assert safe_open_refuses(path) == (phrase != "dtype")


def safe_open_refuses(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in list(f.keys()):
                f.get_tensor(key)
    except Exception:
        return True
    return False


@pytest.mark.parametrize(
    ("raw", "phrase"),
    [
        (b"", "too short"),
        (struct.pack("<Q", 1 << 62) + b"{}", "larger than"),
        (struct.pack("<Q", 100) + b"{}", "does not fit the file"),
    ],
)
def test_bad_header_sizes(tmp_path: Path, raw: bytes, phrase: str) -> None:
    path = tmp_path / WEIGHTS
    path.write_bytes(raw)
    with pytest.raises(AdapterError, match=phrase):
        read_safetensors_header(path, WEIGHTS)


# ---------------------------------------------------------------------------- the adapter
def test_read_adapter_accepts_a_well_formed_adapter(tmp_path: Path) -> None:
    files = read_adapter(str(adapter_dir(tmp_path)), max_rank=8)
    assert (files.rank, files.scaling) == (2, 2.0)
    assert files.keys == {(0, "q_proj"): (A_KEY, B_KEY)}


@pytest.mark.parametrize(
    ("config", "phrase"),
    [
        ({"r": True}, "adapter_config.json:r: must be a positive integer"),
        ({"r": 16}, "exceeds --max-lora-rank"),
        ({"lora_alpha": 1e300}, "lora_alpha"),
        ({"lora_alpha": "8"}, "lora_alpha"),
        ({"use_rslora": "yes"}, "use_rslora"),
        ({"target_modules": [["q_proj"]]}, "target_modules"),
        ({"peft_type": ["LORA"]}, "peft_type"),
        ({"r": 4}, "rank 4 needs"),  # the tensors are rank 2
    ],
)
def test_read_adapter_refuses_bad_configs(
    tmp_path: Path, config: dict[str, Any], phrase: str
) -> None:
    with pytest.raises(AdapterError, match=phrase):
        read_adapter(str(adapter_dir(tmp_path, config)), max_rank=8)


@pytest.mark.parametrize("path", ["a\x00b", "/" + "x" * 5000, "/nonexistent/adapter"])
def test_unusable_paths_are_adapter_errors(path: str) -> None:
    with pytest.raises(AdapterError) as caught:
        read_adapter(path, max_rank=8)
    assert caught.value.param == "lora_path"
