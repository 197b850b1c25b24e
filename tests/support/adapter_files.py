"""LoRA adapter directories made by the test (good and malformed) and the gRPC calls that load,
use and unload them."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import details_of, greedy_request

from tokenwire.v1 import generation_pb2_grpc, models_pb2, models_pb2_grpc

KEY = "adapters-defects-key"


AUTH = (("authorization", f"Bearer {KEY}"),)


PROMPT = [5, 17, 33, 101, 250, 7]


RANK = 4


HEALTH_WITHIN_S = 5.0  # health answers within this while a bad adapter is being refused


DEEP = 3000  # nesting depth of the hostile JSON


CONFIG = "adapter_config.json"


WEIGHTS = "adapter_model.safetensors"


def make_adapter(base: Path, out: Path) -> Path:
    """A random PEFT adapter (rank 4 on q_proj and v_proj) for the model in ``base``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=RANK, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(out)
    return out


# ---------------------------------------------------------------------------- file crafting
def read_header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def write_weights(path: Path, header: dict[str, Any] | str, data: bytes) -> None:
    text = header if isinstance(header, str) else json.dumps(header)
    encoded = text.encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def variant(good: Path, out: Path, edit: Callable[[Path], None]) -> Path:
    shutil.copytree(good, out)
    edit(out)
    return out


def set_config(text: str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        (folder / CONFIG).write_text(text)

    return edit


def edit_config(**changes: Any) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        config = json.loads((folder / CONFIG).read_text())
        config.update(changes)
        (folder / CONFIG).write_text(json.dumps(config))

    return edit


def config_with(key: str, raw_value: str) -> Callable[[Path], None]:
    """Replace ``key``'s value with raw JSON text (what ``json.dumps`` cannot write)."""

    def edit(folder: Path) -> None:
        config = json.loads((folder / CONFIG).read_text())
        config[key] = "@@"
        (folder / CONFIG).write_text(json.dumps(config).replace('"@@"', raw_value))

    return edit


def edit_header(change: Callable[[dict[str, Any], bytes], tuple[Any, bytes]]) -> Any:
    def edit(folder: Path) -> None:
        header, data = read_header(folder / WEIGHTS)
        new_header, new_data = change(header, data)
        write_weights(folder / WEIGHTS, new_header, new_data)

    return edit


def _first_a(header: dict[str, Any]) -> str:
    return next(k for k in header if k.endswith("lora_A.weight"))


def rename_layer(index: str) -> Callable[[dict[str, Any], bytes], tuple[Any, bytes]]:
    def change(header: dict[str, Any], data: bytes) -> tuple[Any, bytes]:
        for key in [k for k in header if ".layers.0." in k]:
            header[key.replace(".layers.0.", f".layers.{index}.")] = header.pop(key)
        return header, data

    return change


def _as_int32(header: dict[str, Any], data: bytes) -> tuple[Any, bytes]:
    header[_first_a(header)]["dtype"] = "I32"  # same width as F32: the offsets still fit
    return header, data


def _deep_metadata(header: dict[str, Any], data: bytes) -> tuple[Any, bytes]:
    text = json.dumps(header)
    return text[:-1] + ', "__metadata__": ' + "[" * DEEP + "]" * DEEP + "}", data


def _three_dims(header: dict[str, Any], data: bytes) -> tuple[Any, bytes]:
    entry = header[_first_a(header)]
    entry["shape"] = [1, *entry["shape"]]
    return header, data


def _rank_two(folder: Path) -> None:
    edit_config(r=2)(folder)  # the tensors say rank 4


BAD = {  # folder -> how it is made from the good adapter, and a phrase of the message
    "deep-config": (set_config("[" * DEEP + "]" * DEEP), "nest"),
    "deep-targets": (config_with("target_modules", "[" * DEEP + "]" * DEEP), "nest"),
    "long-rank": (config_with("r", "1" * 5000), "number"),
    "long-alpha": (config_with("lora_alpha", "1" * 4000), "number"),
    "infinite-alpha": (config_with("lora_alpha", "1e999"), "number"),
    "huge-alpha": (edit_config(lora_alpha=1e300), "lora_alpha"),
    "nan-alpha": (config_with("lora_alpha", "NaN"), "number"),
    "bool-rank": (edit_config(r=True), "adapter_config.json:r"),
    "big-config": (set_config("{" + " " * (2 << 20) + "}"), "larger than"),
    "binary-config": (lambda f: (f / CONFIG).write_bytes(b"\xff\xfe{}"), "UTF-8"),
    "deep-header": (edit_header(_deep_metadata), "nest"),
    "long-layer": (edit_header(rename_layer("9" * 5000)), "tensor name"),
    "far-layer": (edit_header(rename_layer("9999")), "layer 9999 does not exist"),
    "int32-tensor": (edit_header(_as_int32), "dtype"),
    "three-dims": (edit_header(_three_dims), "shape"),
    "rank-mismatch": (_rank_two, "shape"),
    "huge-header-size": (
        lambda f: (f / WEIGHTS).write_bytes(struct.pack("<Q", 1 << 60) + b"{}"),
        "header",
    ),
    "truncated": (lambda f: (f / WEIGHTS).write_bytes((f / WEIGHTS).read_bytes()[:-64]), ""),
}


def make_adapter_root(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Path:
    """A LoRA root holding the good adapter, every BAD variant and symlinked layouts."""
    root = tmp_path_factory.mktemp("defects-lora-root")
    good = make_adapter(model, root / "good")
    for name, (edit, _) in BAD.items():
        variant(good, root / name, edit)
    # Symlinked files: out of the root (refused) and inside it (a hub cache's layout).
    outside = tmp_path_factory.mktemp("defects-outside")
    shutil.copytree(good, outside / "adapter")
    for name, files in (
        ("config-link-out", (CONFIG,)),
        ("weights-link-out", (WEIGHTS,)),
        ("both-link-out", (CONFIG, WEIGHTS)),
    ):
        folder = variant(good, root / name, lambda f: None)
        for file in files:
            (folder / file).unlink()
            os.symlink(outside / "adapter" / file, folder / file)
    blobs = variant(good, root / "blobs", lambda f: None)
    inside = root / "snapshot"
    inside.mkdir()
    for file in (CONFIG, WEIGHTS):
        os.symlink(blobs / file, inside / file)
    return root


def generate(channel: grpc.Channel, model: str = "") -> list[int]:
    request = greedy_request(PROMPT, 4)
    request.model = model
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    return list(stub.Generate(request, metadata=AUTH, timeout=60).choices[0].token_ids)


def load(channel: grpc.Channel, name: str, path: str) -> models_pb2.LoadAdapterResponse:
    stub = models_pb2_grpc.ModelServiceStub(channel)
    request = models_pb2.LoadAdapterRequest(lora_name=name, lora_path=path)
    reply: models_pb2.LoadAdapterResponse = stub.LoadAdapter(request, metadata=AUTH, timeout=60)
    return reply


def unload(channel: grpc.Channel, name: str) -> None:
    stub = models_pb2_grpc.ModelServiceStub(channel)
    stub.UnloadAdapter(models_pb2.UnloadAdapterRequest(lora_name=name), metadata=AUTH, timeout=60)


def refused_load(channel: grpc.Channel, name: str, path: str) -> grpc.RpcError:
    """LoadAdapter must fail INVALID_ARGUMENT naming ``lora_path``; health is checked while
    the call is in flight and must answer SERVING within ``HEALTH_WITHIN_S``."""
    failure: list[grpc.RpcError] = []
    done = threading.Event()

    def call() -> None:
        try:
            load(channel, name, path)
        except grpc.RpcError as exc:
            failure.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=call)
    worker.start()
    health = health_pb2_grpc.HealthStub(channel)
    asked = time.monotonic()
    status = health.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_WITHIN_S).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert time.monotonic() - asked < HEALTH_WITHIN_S
    assert done.wait(60)
    worker.join()
    assert failure, f"{path}: the load was accepted"
    err = failure[0]
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, err.code(), err.details())
    info, _ = details_of(err)
    assert info is not None and info.reason == "INVALID_PARAMETER"
    assert info.metadata["param"] == "lora_path", info.metadata
    assert err.details().startswith("lora_path: "), err.details()
    return err
