"""``CoreClient``: the front's handle on an engine core, wherever it runs.

Two implementations with one shape (vLLM v1's ``InprocClient`` / ``AsyncMPClient``):
``InprocCoreClient`` runs the core on a thread of this process (debugging, tests), and
``MPCoreClient`` runs it in a busy-looping process of its own (what ``tokenwire serve`` uses).
Both are used only from the front's event loop. ``make_core_client`` (``client_factory``)
picks one, or ``DPCoreClient`` over several for ``--data-parallel-size``.
"""

from __future__ import annotations

from typing import Protocol

from tokenwire.runtime.engine.messages import CoreInput, CoreOutput
from tokenwire.runtime.engine.protocol import EngineInfo


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
