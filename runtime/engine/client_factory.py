"""``make_core_client``: the front's handle on its engine core(s), chosen from the config."""

from __future__ import annotations

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.engine.core_client import CoreClient
from tokenwire.runtime.stats import EngineObserver


def make_core_client(
    config: EngineConfig, in_process: bool, core_observer: EngineObserver | None = None
) -> CoreClient:
    """``core_observer`` sees every step inside the core (it must pickle for a process)."""
    if config.parallel.data_parallel_size > 1:
        from tokenwire.runtime.engine.dp_client import make_dp_client

        return make_dp_client(config, in_process, core_observer)
    if in_process:
        from tokenwire.runtime.engine.inproc_client import InprocCoreClient

        return InprocCoreClient(config, core_observer)
    from tokenwire.runtime.engine.core_process import MPCoreClient

    return MPCoreClient(config, core_observer)
