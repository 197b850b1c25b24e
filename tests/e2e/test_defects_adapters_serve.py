"""A bad LoRA adapter against the real ``tokenwire serve`` process tree (front process plus
its separate engine-core process): LoadAdapter of adapters whose files would make a reader
raise (JSON nested thousands deep, a 4000-digit ``lora_alpha``, a 5000-digit layer index,
shapes that do not match the config's rank) and of a folder whose file is symlinked out of
``--lora-root`` is INVALID_ARGUMENT naming ``lora_path``; health answers while each is
refused, an unrelated Generate succeeds afterwards, the same engine-core process serves on,
a good adapter still loads and runs, and SIGTERM ends the server with exit 0."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import grpc
import psutil
import pytest
from adapter_files import BAD, CONFIG, generate, load, make_adapter, refused_load, unload, variant
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serve_process import Served, serve, wait_gone

KEY = "adapters-defects-key"  # the key the shared helpers send
SERVED_BAD = ("deep-config", "long-alpha", "long-layer", "rank-mismatch")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_model_with_tokenizer: Path) -> Path:
    root = tmp_path_factory.mktemp("served-lora-root")
    good = make_adapter(tiny_model_with_tokenizer, root / "good")
    for name in SERVED_BAD:
        variant(good, root / name, BAD[name][0])
    outside = tmp_path_factory.mktemp("served-outside")
    shutil.copytree(good, outside / "adapter")
    linked = variant(good, root / "config-link-out", lambda f: None)
    (linked / CONFIG).unlink()
    os.symlink(outside / "adapter" / CONFIG, linked / CONFIG)
    return root


def test_bad_adapters_never_end_the_served_engine(
    tiny_model_with_tokenizer: Path, root: Path
) -> None:
    served = serve(
        tiny_model_with_tokenizer,
        *("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"),
        *("--allow-runtime-lora-updating", "--api-key", KEY, "--lora-root", str(root)),
    )
    try:
        check_bad_adapters(served)
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=60) == 0
        assert wait_gone(served.group(), 10.0) == []
    finally:
        served.kill()


def check_bad_adapters(served: Served) -> None:
    core_pid = served.core_pid
    with grpc.insecure_channel(served.target) as channel:
        base = generate(channel)
        for folder in (*SERVED_BAD, "config-link-out"):
            err = refused_load(channel, folder, folder)
            phrase = BAD[folder][1] if folder in BAD else "inside the server's --lora-root"
            assert phrase.lower() in err.details().lower(), err.details()
            assert str(root_of(served)) not in err.details()
            # The server keeps serving, on the same engine core.
            assert served.proc.poll() is None
            assert psutil.pid_exists(core_pid) and served.core_pid == core_pid
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert generate(channel) == base
        assert load(channel, "good", "good").model.name == "good"
        assert generate(channel, "good") != base
        unload(channel, "good")
    assert not any("Traceback" in line for line in served.lines)


def root_of(served: Served) -> str:
    args = served.proc.args
    assert isinstance(args, list)
    return str(args[args.index("--lora-root") + 1])
