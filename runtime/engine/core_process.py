"""The engine core in a process of its own, and ``MPCoreClient``, the front's handle on it.

The front binds two ZMQ ``ipc://`` sockets (inputs PUSH -> core PULL, outputs core PUSH ->
front PULL) in a private temporary directory and spawns the core, which connects, builds the
``EngineCore`` and runs ``CoreLoop``. Every record is msgspec-encoded (``codec``); nothing
from a socket is ever unpickled.

No orphans: the core holds the read end of a pipe whose only write end lives in the front;
when the front process dies for any reason (SIGKILL included) the kernel closes it, the
core's watcher thread reads EOF and the core exits at once. The front watches the core's
process sentinel on its event loop: a core that dies turns into ``CoreFailed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.engine.messages import (
    CoreFailed,
    CoreInput,
    CoreOutput,
    CoreStarted,
    Shutdown,
)
from tokenwire.runtime.engine.protocol import EngineInfo
from tokenwire.runtime.engine.spawn_env import core_env_overrides, spawn_environment
from tokenwire.runtime.ipc.codec import InputCodec, OutputCodec
from tokenwire.runtime.ipc.lifeline import watch_parent
from tokenwire.runtime.ipc.sockets import send_or_drop
from tokenwire.runtime.stats import EngineObserver

logger = logging.getLogger("tokenwire.engine")
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [engine-core pid %(process)d] %(message)s"


# ---------------------------------------------------------------------------- core process
def run_core_process(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    parent_pipe: Connection,
    core_observer: EngineObserver | None,
) -> None:
    """Entry point of the core process (spawned): serve until ``Shutdown``, then exit 0."""
    import zmq

    from tokenwire.runtime.engine.core import EngineCore
    from tokenwire.runtime.engine.core_loop import CoreLoop, StatsCollector, engine_info

    # The front owns the lifetime: Ctrl-C, or a SIGTERM sent to the whole process group
    # (systemd, a terminal), starts its drain, during which the core must keep stepping. The
    # core ends on the front's Shutdown, or at once when the front is gone (parent pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent(parent_pipe)
    logging.basicConfig(level=logging.WARNING, format=_LOG_FORMAT)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    send, receive = _wire(inputs, outputs)
    code = 0
    collector = StatsCollector(core_observer)
    try:
        core = EngineCore(config, collector)
    except Exception as exc:  # a startup error: for the operator, naming what to change
        send(CoreFailed(str(exc) or type(exc).__name__, startup=True))
        _close(context, inputs, outputs)
        os._exit(1)
    try:
        send(CoreStarted(engine_info(core)))
        CoreLoop(core, collector, receive, send).run()
        core.shutdown()  # a clean stop: the executor's workers stop with it
    except BaseException as exc:
        logger.exception("engine core failed")
        send(CoreFailed(f"engine loop failed: {type(exc).__name__}: {exc}"))
        code = 1
        with contextlib.suppress(Exception):  # a hung worker would not follow us out
            core.shutdown(graceful=False)
    _close(context, inputs, outputs)
    os._exit(code)


def _wire(
    inputs: Any, outputs: Any
) -> tuple[Callable[[CoreOutput], None], Callable[[bool], list[CoreInput]]]:
    """The core loop's ``send`` and ``receive`` over the core process's two sockets: records
    encoded out (dropped if the front is gone), every waiting input decoded in (``block``:
    wait up to the idle-check period for the first)."""
    import zmq

    from tokenwire.runtime.engine.core_loop import IDLE_CHECK_S

    in_codec, out_codec = InputCodec(), OutputCodec()

    def send(message: CoreOutput) -> None:
        send_or_drop(outputs, out_codec.encode(message))

    def receive(block: bool) -> list[CoreInput]:
        if block:
            inputs.poll(int(1000 * IDLE_CHECK_S))
        messages: list[CoreInput] = []
        while True:
            try:
                frame = inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages
            messages.append(in_codec.decode_input(frame.buffer))

    return send, receive


def _close(context: Any, inputs: Any, outputs: Any) -> None:
    outputs.close(linger=2000)  # deliver what was sent before leaving
    inputs.close(linger=0)
    context.term()


# ---------------------------------------------------------------------------- front side
class MPCoreClient:
    def __init__(
        self,
        config: EngineConfig,
        core_observer: EngineObserver | None = None,
        shutdown_timeout: float = 10.0,
    ) -> None:
        self.config = config
        self.core_observer = core_observer  # must pickle: it is sent to the new process
        self.shutdown_timeout = shutdown_timeout
        self._process: Any = None
        self._dir: str | None = None
        self._exited: asyncio.Future[int] | None = None
        self._parent_pipe: Connection | None = None
        self._out_codec = OutputCodec()
        self._in_codec = InputCodec()

    @property
    def pid(self) -> int:
        return int(self._process.pid) if self._process is not None else 0

    async def start(self) -> EngineInfo:
        import zmq
        import zmq.asyncio

        loop = asyncio.get_running_loop()
        self._dir = tempfile.mkdtemp(prefix="tokenwire-core-")
        input_address = f"ipc://{self._dir}/input"
        output_address = f"ipc://{self._dir}/output"
        self._context = zmq.Context()
        self._inputs = self._context.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._inputs.bind(input_address)
        self._async_context = zmq.asyncio.Context()
        self._outputs = self._async_context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.bind(output_address)
        spawn = multiprocessing.get_context("spawn")
        child_end, self._parent_pipe = spawn.Pipe(duplex=False)
        self._process = spawn.Process(
            target=run_core_process,
            args=(self.config, input_address, output_address, child_end, self.core_observer),
            name="tokenwire-core",
        )
        with spawn_environment(core_env_overrides(os.environ)):
            self._process.start()
        child_end.close()
        self._exited = loop.create_future()
        loop.add_reader(self._process.sentinel, self._on_sentinel)
        first = await self.get_output()
        if isinstance(first, CoreFailed):
            await self._cleanup()
            raise ValueError(first.message)  # startup errors name what to change
        assert isinstance(first, CoreStarted), first
        return first.info

    def _on_sentinel(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._process.sentinel)
        self._process.join(0)
        code = self._process.exitcode
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(-1 if code is None else code)

    def send(self, message: CoreInput) -> None:
        if self._exited is not None and self._exited.done():
            return  # the core is gone; the front has been told through get_output
        send_or_drop(self._inputs, self._in_codec.encode(message))

    async def get_output(self) -> CoreOutput:
        assert self._exited is not None
        if not self._exited.done():
            receiving: asyncio.Future[Any] = asyncio.ensure_future(self._outputs.recv(copy=False))
            waits: set[asyncio.Future[Any]] = {receiving, self._exited}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if receiving.done():
                return self._out_codec.decode_output(receiving.result().buffer)
            receiving.cancel()
        # The core exited: hand over what it sent before it went, then say how it ended.
        if await self._outputs.poll(timeout=200):
            return self._out_codec.decode_output((await self._outputs.recv(copy=False)).buffer)
        return CoreFailed(_exit_message(self._exited.result()))

    async def shutdown(self) -> None:
        if self._process is None:
            return
        if self._exited is not None and not self._exited.done():
            self.send(Shutdown())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._exited), self.shutdown_timeout)
        await self._cleanup()

    async def _cleanup(self) -> None:
        process = self._process
        if process.is_alive():
            process.kill()
        await asyncio.to_thread(process.join)
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(process.sentinel)
        if self._parent_pipe is not None:
            self._parent_pipe.close()
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        self._async_context.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _exit_message(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the engine core process was killed by {name}"
    return f"the engine core process exited with code {code}"
