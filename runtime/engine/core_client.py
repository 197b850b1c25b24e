"""``CoreClient``: the front's handle on an engine core, wherever it runs.

Two implementations with one shape (vLLM v1's ``InprocClient`` / ``AsyncMPClient``):
``InprocCoreClient`` runs the core on a thread of this process (debugging, tests), and
``MPCoreClient`` runs it in a busy-looping process of its own (what ``tokenwire serve`` uses).
Both are used only from the front's event loop.
"""

from __future__ import annotations

from typing import Protocol

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.engine.messages import CoreInput, CoreOutput
from tokenwire.runtime.engine.protocol import EngineInfo
from tokenwire.runtime.stats import EngineObserver


class CoreClient(Protocol):
    @property
    def pid(self) -> int:
        """The process that runs the core."""
        ...

    async def start(self) -> EngineInfo:
        """Start the core and wait until it has loaded the model; ``ValueError`` for a
        startup error naming the flag to change."""
        ...

    def send(self, message: CoreInput) -> None: ...

    async def get_output(self) -> CoreOutput:
        """The next record from the core; ``CoreFailed`` once it is gone."""
        ...

    async def shutdown(self) -> None: ...


def make_core_client(
    config: EngineConfig, in_process: bool, core_observer: EngineObserver | None = None
) -> CoreClient:
    """``core_observer`` sees every step inside the core (it must pickle for a process)."""
    if in_process:
        from tokenwire.runtime.engine.inproc_client import InprocCoreClient

        return InprocCoreClient(config, core_observer)
    from tokenwire.runtime.engine.core_process import MPCoreClient

    return MPCoreClient(config, core_observer)
