"""The core's outputs on the event loop (``AsyncEngineOutputs``, on ``AsyncEngineBase``): one
task reads every message the core sends; a step's record goes to the observer, its token ids
through ``Frontend.process`` to text and into the request streams; replies settle the pending
calls; a request the core failed, a bad parameter or the core's death ends its streams with
the error.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tokenwire.runtime.engine.async_engine_base import AsyncEngineBase
from tokenwire.runtime.engine.messages import (
    AbortRequests,
    CoreFailed,
    IdleReply,
    LoRAReply,
    ResetReply,
    StepResult,
)
from tokenwire.runtime.errors import EngineDeadError, ParameterError
from tokenwire.runtime.front.output_processor import ProcessedStep
from tokenwire.runtime.front.request_stream import RequestFailed, RequestFinished
from tokenwire.runtime.outputs import EngineCoreOutput

logger = logging.getLogger("tokenwire.engine")


class EngineFaultError(RuntimeError):
    """The core failed to serve one request (an engine fault; the engine lives on)."""


class AsyncEngineOutputs(AsyncEngineBase):
    """Routing of the core's outputs, on the engine's state (``async_engine_base``)."""

    # ------------------------------------------------------------------ core outputs
    async def _output_loop(self) -> None:
        while True:
            message = await self.client.get_output()
            try:
                if isinstance(message, StepResult):
                    self._on_step(message)
                elif isinstance(message, IdleReply):
                    reply = self._idle_calls.pop(message.call_id, None)
                    if reply is not None and not reply.done():
                        reply.set_result(message.report)
                elif isinstance(message, LoRAReply):
                    self._loras.on_reply(message)
                elif isinstance(message, ResetReply):
                    done = self._reset_calls.pop(message.call_id, None)
                    if done is not None and not done.done():
                        done.set_result(message.ok)
                elif isinstance(message, CoreFailed):
                    if not self._closing:
                        self._die(message.message)
                    return
            except Exception:
                logger.exception("engine front failed to process a core output")
                self._die("the engine front failed")
                return

    def _on_step(self, result: StepResult) -> None:
        if self.observer is not None:
            for step in result.steps:
                self.observer.on_step(step)
            for stats in result.finished:
                self.observer.on_request_finished(stats)
        if result.snapshot is not None:
            self._snapshot = result.snapshot
        if result.kv_events is not None and self._kv_events is not None:
            self._kv_events.publish(result.kv_events)  # to its core's hub
        outputs = result.outputs
        if any(o.error_param is not None for o in outputs):
            outputs = self._fail_bad_parameters(outputs)
        processed = self.frontend.process(outputs)
        if processed.to_abort:  # stop strings: the choices already ended in the front
            self.client.send(AbortRequests(processed.to_abort))
        for fault in result.faults:
            self.frontend.abort(fault.request_id)
            self._fail(fault.request_id, EngineFaultError(fault.message))
        self._dispatch(processed)
        for holder in result.evicted_holders:
            callback = self._eviction_listeners.pop(holder, None)
            if callback is not None:
                callback()

    def _fail_bad_parameters(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """A choice the core ended on a bad parameter (its constraint did not compile) fails
        its whole request with that ``ParameterError``; the other choices are aborted."""
        kept = []
        for output in outputs:
            if output.error_param is None:
                kept.append(output)
                continue
            request_id = self.frontend.parent_of(output.request_id)
            if request_id is None:
                continue  # already failed through a sibling
            siblings = [c for c in self.frontend.abort(request_id) if c != output.request_id]
            if siblings:
                self.client.send(AbortRequests(siblings))
            self._fail(request_id, ParameterError(output.error_param, str(output.stop_reason)))
        return kept

    def _dispatch(self, step: ProcessedStep) -> None:
        streams = self._streams
        for started in step.started:
            if (stream := streams.get(started.request_id)) is not None:
                stream.put(started)
        for delta in step.deltas:
            if (stream := streams.get(delta.request_id)) is not None:
                stream.put(delta)
        for output in step.finished:
            stream = streams.pop(output.request_id, None)
            if stream is not None:
                self._num_seqs -= stream.num_seqs
                stream.put(RequestFinished(output))
        self._mark_idle()

    def _mark_idle(self) -> None:
        if not self._streams:
            self._idle.set()

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._num_seqs -= stream.num_seqs
            stream.put(RequestFailed(exc))
        self._mark_idle()

    def _die(self, reason: str) -> None:
        logger.error("engine core died: %s", reason)
        self._dead = reason
        for request_id in list(self._streams):
            self.frontend.abort(request_id)
            self._fail(request_id, EngineDeadError(reason))
        pending: list[asyncio.Future[Any]] = [*self._idle_calls.values()]
        pending += self._reset_calls.values()
        for reply in pending:
            if not reply.done():
                reply.set_exception(EngineDeadError(reason))
        self._loras.fail_all(EngineDeadError(reason))
        for callback in self._on_dead:
            callback()
