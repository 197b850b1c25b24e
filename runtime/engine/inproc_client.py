"""``InprocCoreClient``: the engine core on a thread of the front process (debug and tests).

The thread builds the ``EngineCore`` itself (a model must be loaded by the thread that runs
it: measured on 2 CPU cores, a model loaded on another thread ran its decode steps ~1.8x
slower) and then runs the same ``CoreLoop`` as the core process. Records are handed over as
objects: inputs through a queue, outputs onto the front's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.engine.core import EngineCore
from tokenwire.runtime.engine.core_loop import (
    IDLE_CHECK_S,
    CoreLoop,
    StatsCollector,
    engine_info,
)
from tokenwire.runtime.engine.messages import (
    CoreFailed,
    CoreInput,
    CoreOutput,
    CoreStarted,
    Shutdown,
)
from tokenwire.runtime.engine.protocol import EngineInfo
from tokenwire.runtime.stats import EngineObserver

logger = logging.getLogger("tokenwire.engine")


class InprocCoreClient:
    def __init__(self, config: EngineConfig, core_observer: EngineObserver | None = None) -> None:
        self.config = config
        self.core_observer = core_observer
        self.core: EngineCore | None = None  # set on the core thread (tests inject faults)
        self._inputs: queue.SimpleQueue[CoreInput] = queue.SimpleQueue()
        self._outputs: asyncio.Queue[CoreOutput] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return os.getpid()

    async def start(self) -> EngineInfo:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._main, name="tokenwire-core", daemon=True)
        self._thread.start()
        first = await self._outputs.get()
        if isinstance(first, CoreFailed):
            raise ValueError(first.message)  # startup errors name what to change
        assert isinstance(first, CoreStarted), first
        return first.info

    def send(self, message: CoreInput) -> None:
        self._inputs.put(message)

    async def get_output(self) -> CoreOutput:
        return await self._outputs.get()

    async def shutdown(self) -> None:
        self._inputs.put(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # ------------------------------------------------------------------ the core thread
    def _main(self) -> None:
        collector = StatsCollector(self.core_observer)
        try:
            self.core = EngineCore(self.config, collector)
        except Exception as exc:  # a startup error: for the operator, naming what to change
            self._publish(CoreFailed(str(exc) or type(exc).__name__, startup=True))
            return
        self._publish(CoreStarted(engine_info(self.core)))
        graceful = True
        try:
            CoreLoop(self.core, collector, self._receive, self._publish).run()
        except BaseException as exc:  # the loop must report, never die silently
            logger.exception("engine core loop failed")
            self._publish(CoreFailed(f"engine loop failed: {type(exc).__name__}: {exc}"))
            graceful = False
        self.core.shutdown(graceful)

    def _receive(self, block: bool) -> list[CoreInput]:
        try:
            messages = [self._inputs.get(block=block, timeout=IDLE_CHECK_S if block else None)]
        except queue.Empty:
            return []
        with contextlib.suppress(queue.Empty):
            while True:
                messages.append(self._inputs.get_nowait())
        return messages

    def _publish(self, message: CoreOutput) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens any more
            self._loop.call_soon_threadsafe(self._outputs.put_nowait, message)
