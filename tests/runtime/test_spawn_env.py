"""The spawned engine core's OpenMP threads spin briefly, then sleep (``GOMP_SPINCOUNT=10000``,
issue 42): read from the real core process's ``/proc/PID/environ``; a user's own setting wins,
and the front's environment is left as it was."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_models import TEST_KV_CACHE_BYTES

from tokenwire.runtime.config import CacheConfig, EngineConfig, ModelConfig
from tokenwire.runtime.engine.core_process import MPCoreClient
from tokenwire.runtime.engine.spawn_env import core_env_overrides, spawn_environment


def test_overrides_leave_a_users_setting_alone() -> None:
    assert core_env_overrides({}) == {"GOMP_SPINCOUNT": "10000"}
    assert core_env_overrides({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert core_env_overrides({"GOMP_SPINCOUNT": "300000"}) == {}


def test_spawn_environment_restores_the_front(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    with spawn_environment({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}):
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == "0"
    assert "OMP_WAIT_POLICY" not in os.environ and os.environ["GOMP_SPINCOUNT"] == "7"


def _core_environ(model: Path) -> dict[str, str]:
    config = EngineConfig(
        model=ModelConfig(model=str(model), max_model_len=64),
        cache=CacheConfig(kv_cache_memory=TEST_KV_CACHE_BYTES),
        device="cpu",
    )

    async def run() -> dict[str, str]:
        client = MPCoreClient(config)
        await client.start()
        try:
            raw = Path(f"/proc/{client.pid}/environ").read_bytes()
        finally:
            await client.shutdown()
        pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        return {k.decode(): v.decode() for k, v in pairs}

    return asyncio.run(run())


@pytest.mark.parametrize("user", [None, "ACTIVE"])
def test_the_real_core_process_spins_briefly_unless_the_user_chose(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, user: str | None
) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    if user is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", user)
    environ = _core_environ(tiny_model_factory("llama"))
    assert environ.get("GOMP_SPINCOUNT") == (None if user else "10000")
    assert environ.get("OMP_WAIT_POLICY") == user
    assert "GOMP_SPINCOUNT" not in os.environ  # the front's own is unchanged
