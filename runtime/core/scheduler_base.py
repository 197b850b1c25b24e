"""The scheduler's state and its requests in and out (``SchedulerBase``): the queues, the
request table, finishing a request (its blocks freed or held for a Session), holders evicted
under the session budget (moved down a KV tier when there is one). ``scheduler_update`` adds
``update()`` on top and ``scheduler`` the ``schedule()`` that hands out each step's tokens.
Imports no torch.
"""

from __future__ import annotations

import time

from tokenwire.runtime.config import SchedulerConfig
from tokenwire.runtime.core.encoder_cache import EncoderCacheManager
from tokenwire.runtime.core.kv_cache_manager import KVCacheManager
from tokenwire.runtime.core.kv_connector_api import KVConnector
from tokenwire.runtime.core.request import Request, RequestStatus
from tokenwire.runtime.core.request_queue import make_queue
from tokenwire.runtime.core.spec.draft_slots import Proposer
from tokenwire.runtime.lora.admission import LoRAAdmission
from tokenwire.runtime.outputs import EngineCoreOutput, FinishReason
from tokenwire.runtime.structured.manager import StructuredOutputManager


class SchedulerBase:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        max_held_blocks: int = 0,
        structured: StructuredOutputManager | None = None,
        lora: LoRAAdmission | None = None,
        proposer: Proposer | None = None,
        connector: KVConnector | None = None,
        encoder_only: bool = False,
    ) -> None:
        self.config = config
        self.connector = connector  # KV tiers (docs/kv-tiers.md); None: off
        # An encoder model (bidirectional attention): each prompt runs whole in one step.
        self.encoder_only = encoder_only
        self.lora = lora  # None: LoRA is not enabled
        self.proposer = proposer  # None: no speculative decoding
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        # Budget for blocks pinned by holders (sessions) between their requests.
        self.max_held_blocks = max_held_blocks
        # Holders whose tables were released under memory pressure; drained by the engine.
        self._evicted_holders: list[str] = []
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.scheduling_policy)
        # Invariant (priority policy): sorted by Request.sort_key, so the tail is the victim.
        self.running: list[Request] = []
        # Requests the executor has state for that finished since the last schedule().
        self._finished_ids: set[str] = set()
        # Finished since the engine last asked (for its observer); drained by the engine.
        self._finished_requests: list[Request] = []
        self._step_id = 0
        self.num_preemptions_total = 0
        # Constrained decoding: the manager, unfinished constrained requests, and outputs of
        # requests whose grammar failed (reported by the next ``update``).
        self.structured = structured
        self._num_constrained = 0
        # Image inputs: the book of the worker's encoder-output cache and the step's budget.
        self.encoder = EncoderCacheManager(config.encoder_capacity, config.encoder_budget)
        self._grammar_failures: list[EngineCoreOutput] = []

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("this scheduler has no structured-output manager")
            self.structured.register(request)
            self._num_constrained += 1
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(
        self, request_ids: list[str], reason: FinishReason = FinishReason.CANCELLED
    ) -> list[Request]:
        """Remove requests wherever they are and free their blocks; returns those removed."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, reason)
            aborted.append(request)
        return aborted

    def _finish(
        self, request: Request, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """Mark finished and release blocks (caller already removed it from its queue)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.finished_time = time.monotonic()
        if request.images:
            self.encoder.free_request(request.request_id)
        if request.grammar is not None:
            self._num_constrained -= 1
        if self.connector is not None:  # KV tiers: free what a pending load holds
            self.connector.request_finished(request.request_id)
        if request.hold_as is None:
            self.kv.free(request)
        else:
            self.kv.hold(request, request.hold_as)
            while self.kv.num_held_blocks > self.max_held_blocks and self._evict_holder(
                keep=request.hold_as
            ):
                pass
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
        self._finished_requests.append(request)

    def _evict_holder(self, keep: str | None = None) -> bool:
        """Release the least recently held table (not ``keep``); False if there is none."""
        holder = self.kv.oldest_holder()
        if holder is None or holder == keep:
            return False
        # KV tiers: the table moves down to the host tier; evicted only when it cannot.
        tiers = self.connector
        moved = tiers is not None and tiers.hold_session(holder, self.kv.held_cached(holder))
        self.kv.release(holder)
        if not moved:
            self._evicted_holders.append(holder)
        return True

    def release_holder(self, holder_id: str) -> bool:
        moved = self.connector is not None and self.connector.unhold_session(holder_id)
        return self.kv.release(holder_id) or moved

    def pop_evicted_holders(self) -> list[str]:
        evicted, self._evicted_holders = self._evicted_holders, []
        return evicted

    def pop_finished_requests(self) -> list[Request]:
        finished, self._finished_requests = self._finished_requests, []
        return finished

    def has_unfinished_requests(self) -> bool:
        # KV tiers: a load of an aborted request still holds blocks until it is acknowledged.
        return bool(self.requests) or (self.connector is not None and self.connector.has_pending)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
