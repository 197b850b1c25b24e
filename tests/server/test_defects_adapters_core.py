"""Where a bad adapter is stopped (in-process harness: the engine core on a thread, so the
test can watch it): the front reads the adapter's files before anything is sent, so a
hostile one never reaches the core; and should reading them in the core raise anything at
all (a reader bug), that one load is refused, the core loop goes on, and the engine serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from adapter_files import BAD, generate, load, make_adapter, refused_load, unload, variant
from grpc_helpers import spy_on
from server_harness import ServerHarness

from tokenwire.runtime.config import LoRAConfig

KEY = "adapters-defects-key"  # the key the shared helpers send


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_model_with_tokenizer: Path) -> Path:
    root = tmp_path_factory.mktemp("core-lora-root")
    good = make_adapter(tiny_model_with_tokenizer, root / "good")
    for name in ("deep-config", "long-layer"):
        variant(good, root / name, BAD[name][0])
    return root


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options(root: Path) -> dict[str, Any]:
    return dict(
        api_keys=(KEY,),
        lora=LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8),
        allow_runtime_lora_updating=True,
        lora_root=str(root),
        in_process=True,
    )


@pytest.mark.parametrize("folder", ["deep-config", "long-layer"])
def test_a_hostile_adapter_never_reaches_the_core(
    harness: ServerHarness,
    channel: grpc.Channel,
    monkeypatch: pytest.MonkeyPatch,
    folder: str,
) -> None:
    core_add = spy_on(monkeypatch, harness.core, "add_lora")
    refused_load(channel, folder, folder)
    assert core_add.calls == []  # refused by the front
    assert not harness.engine.is_dead and len(generate(channel)) == 4
    harness.assert_idle()


def test_anything_a_core_side_read_raises_refuses_only_that_load(
    harness: ServerHarness, channel: grpc.Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A good adapter passes the front; the core's reader then raises what no reader should
    (standing in for a bug): the load is INVALID_ARGUMENT naming lora_path, with no path or
    traceback in the message, and the engine serves on and loads the adapter afterwards."""
    registry = harness.core.loras

    def broken(name: str, path: str) -> None:
        raise RecursionError(f"maximum recursion depth exceeded reading {path}")

    with monkeypatch.context() as patch:
        patch.setattr(registry, "add", broken)
        err = refused_load(channel, "good", "good")
    assert "RecursionError" in err.details() and "recursion depth" not in err.details()
    assert not harness.engine.is_dead and len(generate(channel)) == 4
    assert load(channel, "good", "good").model.name == "good"
    assert len(generate(channel, "good")) == 4
    unload(channel, "good")
    harness.assert_idle()
