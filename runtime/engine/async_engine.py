"""``AsyncEngine``: the ``EngineClient`` every server front uses (vLLM v1's ``AsyncLLM``).

It holds the front's text pipeline (``Frontend``: tokenizer, request checks, ``n > 1``
fan-out, incremental detokenization, stop strings) and adds what is async: the event loop's
per-request output streams, admission and idle tracking, the tokenizer load and grammar parses
on threads (prompts are tokenized by the caller, off the loop: the server's
``TokenizerPool``). The engine core (scheduler, KV cache, model) runs behind a
``CoreClient``: in a process of its own by default, or on a thread (``in_process``). While
the core computes the next step, the loop turns the previous step's token ids into text. One
record per step carries every request's tokens, the step and request statistics (handed to
``observer`` here, on the loop) and a state snapshot.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

from tokenwire.runtime.config import DEFAULT_MAX_REQUESTS, EngineConfig
from tokenwire.runtime.engine.client_factory import make_core_client
from tokenwire.runtime.engine.core_client import CoreClient
from tokenwire.runtime.engine.dp_merge import idle_snapshot
from tokenwire.runtime.engine.messages import (
    AbortRequests,
    AddRequest,
    CheckIdle,
    ChildRequest,
    CoreFailed,
    IdleReply,
    LoRAReply,
    ReleaseHolder,
    ResetPrefixCache,
    ResetReply,
    StepResult,
)
from tokenwire.runtime.engine.protocol import EngineInfo, EngineStatsSnapshot, IdleReport
from tokenwire.runtime.errors import (
    AdapterNotFoundError,
    DrainingError,
    DuplicateRequestError,
    EngineDeadError,
    NotReadyError,
    ParameterError,
    QueueFullError,
)
from tokenwire.runtime.front.frontend import Frontend
from tokenwire.runtime.front.kv_event_hub import KVEventStream
from tokenwire.runtime.front.kv_events_front import KVEventsFront
from tokenwire.runtime.front.lora_front import LoRAFront
from tokenwire.runtime.front.output_processor import ProcessedStep
from tokenwire.runtime.front.request_stream import RequestFailed, RequestFinished, RequestStream
from tokenwire.runtime.front.tokenizer import Tokenizer
from tokenwire.runtime.front.validation import check_task, validate_priority, validate_rank
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.multimodal import ImageInput, check_images
from tokenwire.runtime.outputs import EngineCoreOutput
from tokenwire.runtime.sampling_params import SamplingParams, embedding_params
from tokenwire.runtime.stats import EngineObserver

logger = logging.getLogger("tokenwire.engine")


class EngineFaultError(RuntimeError):
    """The core failed to serve one request (an engine fault; the engine lives on)."""


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        observer: EngineObserver | None = None,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        in_process: bool = False,
        core_observer: EngineObserver | None = None,
    ) -> None:
        self.config = config
        self.observer = observer  # front side: sees every step's and request's statistics
        self.max_requests = max_requests  # sequences in flight (a request counts n)
        self.client: CoreClient = make_core_client(config, in_process, core_observer)
        self.ready = False  # set after warm-up; until then requests get NOT_READY
        self.draining = False
        self._info: EngineInfo | None = None
        self._frontend: Frontend | None = None
        self._streams: dict[str, RequestStream] = {}
        self._num_seqs = 0
        self._eviction_listeners: dict[str, Callable[[], None]] = {}
        self._on_dead: list[Callable[[], None]] = []
        self._dead: str | None = None
        self._closing = False
        self._loras = LoRAFront(self.client.send)
        self._idle = asyncio.Event()  # set while no stream is open
        self._idle.set()
        self._snapshot = EngineStatsSnapshot()
        self._idle_calls: dict[int, asyncio.Future[IdleReport]] = {}
        self._call_ids = itertools.count()
        self._output_task: asyncio.Task[None] | None = None
        self._kv_events = KVEventsFront.make(config)  # None unless --kv-events-config
        self._reset_calls: dict[int, asyncio.Future[bool]] = {}

    # ------------------------------------------------------------------ facts
    @property
    def info(self) -> EngineInfo:
        assert self._info is not None, "start() first"
        return self._info

    @property
    def frontend(self) -> Frontend:
        assert self._frontend is not None, "start() first"
        return self._frontend

    @property
    def tokenizer(self) -> Tokenizer | None:
        return None if self._frontend is None else self._frontend.tokenizer

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_seqs_in_flight(self) -> int:
        """Sequences of the open streams (a request with ``n`` choices counts ``n``)."""
        return self._num_seqs

    def stats_snapshot(self) -> EngineStatsSnapshot:
        return self._snapshot

    @property
    def kv_events(self) -> KVEventStream | None:
        """The KV-cache event stream (None unless ``--kv-events-config`` enables it): the one
        core's hub, or with several cores every rank's batches merged
        (``front.kv_event_merge``)."""
        return None if self._kv_events is None else self._kv_events.stream

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the core, wait until it has loaded the model, load the tokenizer (off the
        loop) from what the core published."""
        if self._kv_events is not None:
            self._kv_events.start()  # a bad endpoint fails before the model loads
        info = await self.client.start()
        self._info = info
        self._loras.seed(info.lora_adapters, info.max_lora_rank)
        self._frontend = await asyncio.to_thread(Frontend.from_info, info)
        self._snapshot = idle_snapshot(info)  # every core's blocks, not only the first's
        self._output_task = asyncio.create_task(self._output_loop(), name="tokenwire-outputs")

    async def warmup(self) -> None:
        """Run one tiny request end to end (first-step costs, allocator, caches)."""
        stream = self.add_request(
            "warmup",
            None,
            [1, 2, 3],
            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            if self.info.embed is None
            else embedding_params(None),
            before_ready=True,
        )
        async for item in stream:
            if isinstance(item, RequestFailed):
                raise item.error
        self.ready = True

    async def drain(self, timeout: float) -> None:
        """Refuse new work, let in-flight requests finish up to ``timeout`` s, abort the rest."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            for request_id in list(self._streams):
                self.abort(request_id)

    async def shutdown(self) -> None:
        self._closing = True
        if self._frontend is not None:
            self._frontend.close()
        await self.client.shutdown()
        if self._kv_events is not None:
            await self._kv_events.close()
        if self._output_task is not None:
            self._output_task.cancel()
            await asyncio.gather(self._output_task, return_exceptions=True)

    async def reset_prefix_cache(self, timeout: float = 30.0) -> bool:
        """Forget every cached block; False (nothing changed) while any block is in use."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        call_id = next(self._call_ids)
        reply: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._reset_calls[call_id] = reply
        self.client.send(ResetPrefixCache(call_id))
        try:
            return await asyncio.wait_for(reply, timeout)
        finally:
            self._reset_calls.pop(call_id, None)

    async def check_idle(self, timeout: float = 30.0) -> IdleReport:
        """The core's own account of its state once every earlier command is applied."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        call_id = next(self._call_ids)
        reply: asyncio.Future[IdleReport] = asyncio.get_running_loop().create_future()
        self._idle_calls[call_id] = reply
        self.client.send(CheckIdle(call_id))
        try:
            return await asyncio.wait_for(reply, timeout)
        finally:
            self._idle_calls.pop(call_id, None)

    async def wait_idle(self, timeout: float) -> bool:
        """Every stream ended and the core has applied every command sent before (e.g. a
        session's release); True if that happened within ``timeout``."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            await self.check_idle(timeout)
        except TimeoutError:
            return False
        return True

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        hold_as: str | None = None,
        lora_request: LoRARequest | None = None,
        data_parallel_rank: int | None = None,
        before_ready: bool = False,
        images: tuple[ImageInput, ...] = (),
    ) -> RequestStream:
        """Validate and send to the core; raises before anything is sent."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not (self.ready or before_ready):
            raise NotReadyError("the model is still loading or warming up")
        if self.draining:
            raise DrainingError("the server is draining and accepts no new requests")
        if request_id in self._streams:
            raise DuplicateRequestError(request_id)
        if self._num_seqs + params.n > self.max_requests:
            raise QueueFullError(
                f"the server holds {self._num_seqs} sequences in flight and this request "
                f"needs {params.n}; its limit is {self.max_requests}"
            )
        if lora_request is not None and self._loras.get(lora_request.lora_name) != lora_request:
            raise AdapterNotFoundError(lora_request.lora_name)
        validate_priority(priority)  # what the wire to the core carries
        validate_rank(data_parallel_rank, self.info.data_parallel_size)
        check_task(self.info.served_model_name, self.info.embed, params)
        check_images(images, len(prompt_token_ids))
        # No grammar work here, on the loop: a constraint not known to parse is left to the
        # core's compile pool (``check_constraint`` parses it off the loop beforehand).
        frontend = self.frontend
        children = frontend.add_request(request_id, prompt, prompt_token_ids, params)
        stream = RequestStream(request_id, params.n)
        self._streams[request_id] = stream
        self._num_seqs += params.n
        self._idle.clear()
        # Only choice 0 continues a session, so only its blocks are held.
        message = AddRequest(
            request_id,
            list(prompt_token_ids),
            [
                ChildRequest(child_id, child_params, hold_as if i == 0 else None)
                for i, (child_id, child_params) in enumerate(children)
            ],
            priority,
            cache_salt,
            lora_request,
            data_parallel_rank,
            images,
        )
        try:
            self.client.send(message)
        except Exception:  # not sent (e.g. a value the wire cannot encode): nothing stays
            frontend.abort(request_id)
            self._streams.pop(request_id, None)
            self._num_seqs -= params.n
            self._mark_idle()
            raise
        return stream

    async def check_constraint(self, params: SamplingParams) -> None:
        """Parse ``params``' structured-output constraint off the loop, limits first;
        ``ParameterError`` naming the field. Call before ``add_request``."""
        await self.frontend.structured.check_async(params)

    def abort(self, request_id: str) -> bool:
        """Cancel an in-flight request (its choices end CANCELLED). True once per request."""
        stream = self._streams.get(request_id)
        if stream is None or stream.done or stream.abort_requested:
            return False
        stream.abort_requested = True
        children = self.frontend.unfinished_children(request_id)
        if children and self._dead is None:
            self.client.send(AbortRequests(children))
        return True

    # ------------------------------------------------------------------ LoRA adapters
    def get_lora(self, name: str) -> LoRARequest | None:
        return self._loras.get(name)

    def list_loras(self) -> list[LoRARequest]:
        return self._loras.list()

    async def add_lora(self, name: str, path: str) -> LoRARequest:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        return await self._loras.add(name, path)

    async def remove_lora(self, name: str) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        await self._loras.remove(name)

    def release_holder(self, holder_id: str) -> None:
        self._eviction_listeners.pop(holder_id, None)
        if self._dead is None:
            self.client.send(ReleaseHolder(holder_id))

    def on_holder_evicted(self, holder_id: str, callback: Callable[[], None]) -> None:
        """Call ``callback`` when memory pressure drops the holder's blocks."""
        self._eviction_listeners[holder_id] = callback

    def on_dead(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the loop) if the engine core dies."""
        self._on_dead.append(callback)

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
