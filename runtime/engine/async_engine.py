"""``AsyncEngine``: the ``EngineClient`` every server front uses (vLLM v1's ``AsyncLLM``).

It holds the front's text pipeline (``Frontend``: tokenizer, request checks, ``n > 1``
fan-out, incremental detokenization, stop strings) and adds what is async: the event loop's
per-request output streams, admission and idle tracking, the tokenizer load and grammar parses
on threads (prompts are tokenized by the caller, off the loop: the server's
``TokenizerPool``). The engine core (scheduler, KV cache, model) runs behind a
``CoreClient``: in a process of its own by default, or on a thread (``in_process``). While
the core computes the next step, the loop turns the previous step's token ids into text. One
record per step carries every request's tokens, the step and request statistics (handed to
``observer`` here, on the loop) and a state snapshot. The engine's state and the facts it
reports are ``async_engine_base``; the routing of the core's outputs is
``async_engine_outputs``; this module adds the lifecycle and the request intake.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tokenwire.runtime.engine.async_engine_outputs import AsyncEngineOutputs
from tokenwire.runtime.engine.dp_merge import idle_snapshot
from tokenwire.runtime.engine.messages import (
    AbortRequests,
    AddRequest,
    CheckIdle,
    ChildRequest,
    ReleaseHolder,
    ResetPrefixCache,
)
from tokenwire.runtime.engine.protocol import IdleReport
from tokenwire.runtime.errors import (
    AdapterNotFoundError,
    DrainingError,
    DuplicateRequestError,
    EngineDeadError,
    NotReadyError,
    QueueFullError,
)
from tokenwire.runtime.front.frontend import Frontend
from tokenwire.runtime.front.request_stream import RequestFailed, RequestStream
from tokenwire.runtime.front.score_pairs import score_params
from tokenwire.runtime.front.validation import check_task, validate_priority, validate_rank
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.multimodal import ImageInput, check_images
from tokenwire.runtime.sampling_params import SamplingParams, embedding_params


class AsyncEngine(AsyncEngineOutputs):
    """Lifecycle, request intake and the calls the server makes, on the engine's state
    (``async_engine_base``) and its output routing (``async_engine_outputs``)."""

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
            else score_params(1)
            if self.info.embed.cross_encoder
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
        self._check_admission(request_id, params.n, before_ready)
        if lora_request is not None and self._loras.get(lora_request.lora_name) != lora_request:
            raise AdapterNotFoundError(lora_request.lora_name)
        validate_priority(priority)  # what the wire to the core carries
        validate_rank(data_parallel_rank, self.info.data_parallel_size)
        check_task(self.info.served_model_name, self.info.embed, params)
        check_images(images, len(prompt_token_ids))
        # No grammar work here, on the loop: a constraint not known to parse is left to the
        # core's compile pool (``check_constraint`` parses it off the loop beforehand).
        children = self.frontend.add_request(request_id, prompt, prompt_token_ids, params)
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
            self._forget_unsent(request_id, params.n)
            raise
        return stream

    def _check_admission(self, request_id: str, num_seqs: int, before_ready: bool) -> None:
        """Whether the engine takes a request now: alive, ready (or the warm-up), not
        draining, its id not in flight, its ``num_seqs`` sequences within ``max_requests``."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not (self.ready or before_ready):
            raise NotReadyError("the model is still loading or warming up")
        if self.draining:
            raise DrainingError("the server is draining and accepts no new requests")
        if request_id in self._streams:
            raise DuplicateRequestError(request_id)
        if self._num_seqs + num_seqs > self.max_requests:
            raise QueueFullError(
                f"the server holds {self._num_seqs} sequences in flight and this request "
                f"needs {num_seqs}; its limit is {self.max_requests}"
            )

    def _forget_unsent(self, request_id: str, num_seqs: int) -> None:
        """Undo ``add_request``'s bookkeeping for a request the core never got."""
        self.frontend.abort(request_id)
        self._streams.pop(request_id, None)
        self._num_seqs -= num_seqs
        self._mark_idle()

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
