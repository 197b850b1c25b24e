"""Defects of LoRA adapter loading (real gRPC server, engine core in its own process, tiny
random llama, adapters made here):

- an adapter whose files would make a reader raise (JSON nested thousands deep, integers of
  thousands of digits, an infinite ``lora_alpha``, a huge layer index in a tensor name, a
  tensor dtype the engine does not serve, shapes that do not match its rank or the model)
  is INVALID_ARGUMENT naming ``lora_path``; health answers while it is refused, and the
  engine serves on (an unrelated Generate succeeds, the same core process runs);
- ``--lora-root``: a folder inside the root whose ``adapter_config.json`` or
  ``adapter_model.safetensors`` is a symlink to a file outside it is refused; a symlink to a
  file inside the root (a hub cache's layout) is fine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from adapter_files import (
    AUTH,
    BAD,
    KEY,
    generate,
    load,
    make_adapter_root,
    refused_load,
    unload,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_harness import ServerHarness

from tokenwire.runtime.config import LoRAConfig
from tokenwire.v1 import models_pb2, models_pb2_grpc


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_model_with_tokenizer: Path) -> Path:
    return make_adapter_root(tmp_path_factory, tiny_model_with_tokenizer)


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options(root: Path) -> dict[str, Any]:
    lora = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    return dict(api_keys=(KEY,), lora=lora, allow_runtime_lora_updating=True, lora_root=str(root))


def assert_serving(harness: ServerHarness, channel: grpc.Channel, core_pid: int) -> None:
    assert not harness.engine.is_dead
    assert harness.core_pid == core_pid
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert len(generate(channel)) == 4


@pytest.mark.parametrize("folder", sorted(BAD))
def test_a_bad_adapter_is_invalid_argument_and_the_engine_serves_on(
    harness: ServerHarness, channel: grpc.Channel, root: Path, folder: str
) -> None:
    core_pid = harness.core_pid
    err = refused_load(channel, folder, folder)
    assert BAD[folder][1].lower() in err.details().lower(), err.details()
    assert str(root) not in err.details() and "Traceback" not in err.details()
    assert len(err.details()) < 600
    assert_serving(harness, channel, core_pid)
    harness.assert_idle()


def test_the_good_adapter_loads_and_changes_the_output(
    harness: ServerHarness, channel: grpc.Channel
) -> None:
    base = generate(channel)
    assert load(channel, "good", "good").model.name == "good"
    try:
        assert generate(channel, "good") != base
    finally:
        unload(channel, "good")
    harness.assert_idle()


# ---------------------------------------------------------------------------- --lora-root
@pytest.mark.parametrize("folder", ["config-link-out", "weights-link-out", "both-link-out"])
def test_a_file_symlink_out_of_the_root_is_refused(
    harness: ServerHarness, channel: grpc.Channel, root: Path, folder: str
) -> None:
    err = refused_load(channel, folder, folder)
    assert "inside the server's --lora-root" in err.details(), err.details()
    assert str(root) not in err.details() and "defects-outside" not in err.details()
    names = [
        m.name
        for m in models_pb2_grpc.ModelServiceStub(channel)
        .ListModels(models_pb2.ListModelsRequest(), metadata=AUTH)
        .models
    ]
    assert folder not in names
    harness.assert_idle()


def test_a_file_symlink_inside_the_root_is_fine(
    harness: ServerHarness, channel: grpc.Channel
) -> None:
    assert load(channel, "snap", "snapshot").model.name == "snap"
    try:
        assert len(generate(channel, "snap")) == 4
    finally:
        unload(channel, "snap")
    harness.assert_idle()
