"""Token-budget continuous-batching scheduler (vLLM v1 semantics, no separate phases).

Each ``schedule()`` hands out at most ``max_num_batched_tokens`` tokens to at most
``max_num_seqs`` sequences: running requests first (one decode token, or their next prefill
chunk), then waiting requests by policy while blocks allow. When blocks run out, the running
request at the tail (lowest priority / latest) is preempted by recompute. ``update()`` is the
only place where request progress advances. Imports no torch.

Constrained requests (``SamplingParams.structured_outputs``) wait in the queue until their
grammar has compiled (``StructuredOutputManager``); each step carries the token bitmask of
the constrained rows that sample, and ``update()`` advances their matchers.
"""

from __future__ import annotations

import bisect
import time

from tokenwire.runtime.config import SchedulerConfig
from tokenwire.runtime.core.encoder_cache import EncoderCacheManager, EncoderPlan
from tokenwire.runtime.core.kv_cache_manager import KVCacheManager
from tokenwire.runtime.core.kv_connector_api import KVConnector
from tokenwire.runtime.core.placeholders import advance, finishes_by_length, settle
from tokenwire.runtime.core.request import Request, RequestStatus
from tokenwire.runtime.core.request_queue import make_queue
from tokenwire.runtime.core.spec.accept import accept_drafts
from tokenwire.runtime.core.spec.draft_slots import Proposer
from tokenwire.runtime.core.step_builder import StepBuilder
from tokenwire.runtime.core.stop_check import token_stop
from tokenwire.runtime.lora.admission import LoRAAdmission
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.outputs import EngineCoreOutput, FinishReason
from tokenwire.runtime.scheduler_output import NewRequestData, SchedulerOutput
from tokenwire.runtime.structured.manager import StructuredOutputManager, failure_output


class Scheduler:
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

    # ------------------------------------------------------------------ schedule
    def schedule(self, late_grammar: bool = False) -> SchedulerOutput:
        """The next step. ``late_grammar`` (async scheduling): leave its grammar bitmask out;
        the engine builds it once the step in flight is reconciled (``grammar_rows``)."""
        if self.structured is not None and self.structured.num_pending:
            self._poll_grammars()
        step = StepBuilder(self.config.max_num_batched_tokens)
        self.encoder.start_step()
        self._schedule_running(step)
        # A step that had to preempt has no room for newcomers (vLLM v1 rule).
        if not step.preempted:
            self._schedule_waiting(step)
        self._step_id += 1
        finished = frozenset(self._finished_ids)
        self._finished_ids.clear()
        return SchedulerOutput(
            step_id=self._step_id,
            new_reqs=step.new_reqs,
            cached_reqs=step.cached,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.budget,
            num_prefill_tokens=step.num_prefill_tokens,
            num_decode_tokens=step.num_decode_tokens,
            finished_req_ids=finished,
            preempted_req_ids=frozenset(r.request_id for r in step.preempted),
            grammar_bitmask=self.structured.bitmask_for(
                step.num_scheduled, self.requests, step.spec_tokens
            )
            if self.structured is not None and self._num_constrained and not late_grammar
            else None,
            removed_lora_ids=frozenset()
            if self.lora is None
            else self.lora.ready_removals(self.requests.values()),
            spec_token_ids=step.spec_tokens,
            kv_transfers=None if self.connector is None else self.connector.build_plan(),
            encoder_inputs=step.encoder_inputs,
            encoder_frees=self.encoder.drain_frees(),
            num_encoder_cache_hits=step.num_encoder_cache_hits,
        )

    def _poll_grammars(self) -> None:
        """Matchers for compiled grammars; a failed one ends its (waiting) request: ERROR
        with the compiler's message as ``stop_reason`` and the field as ``error_param``,
        reported by the next ``update``."""
        assert self.structured is not None
        for request, message in self.structured.poll():
            self.waiting.remove(request)
            self._finish(request, FinishReason.ERROR, message)
            self._grammar_failures.append(failure_output(request, message))

    def _schedule_running(self, step: StepBuilder) -> None:
        # Hot path (every running request, every step): locals instead of attribute lookups.
        running = self.running
        allocate = self.kv.allocate_slots
        num_scheduled = step.num_scheduled
        cached = step.cached
        ids, resumed, blocks, computed = (
            cached.request_ids,
            cached.resumed_from_preemption,
            cached.new_block_ids,
            cached.num_computed_tokens,
        )
        start_budget = budget = step.budget
        prefill = 0
        i = 0
        proposer = None if self.proposer is None else self.proposer.active(len(running))
        while i < len(running) and budget > 0:
            request = running[i]
            num_computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders  # async scheduling; else 0
            if placeholders and finishes_by_length(request):
                i += 1
                continue  # its pending update finishes it
            num_new = min(len(request.token_ids) + placeholders - num_computed, budget)
            plan = self._plan_images(request, num_computed, num_new)
            if plan is not None and not (num_new := plan.num_new):
                i += 1
                continue  # its next image does not fit this step
            if proposer is not None and num_new == 1 and num_computed >= request.num_prompt_tokens:
                draft = proposer.propose(request, budget)
                if draft:
                    step.spec_tokens[request.request_id] = draft
                    num_new += len(draft)
            new_block_ids = allocate(request, num_new)
            if new_block_ids is None:
                step.budget = budget
                new_block_ids = self._allocate_or_preempt(request, num_new, step)
                if new_block_ids is None:
                    step.spec_tokens.pop(request.request_id, None)
                    break  # ``request`` itself was preempted: everything after it is gone too
            request_id = request.request_id
            if plan is not None:
                self._commit_encoder(request, plan, step)
            num_scheduled[request_id] = num_new
            budget -= num_new
            if num_computed < request.num_prompt_tokens:  # a running chunked prefill
                prefill += min(num_new, request.num_prompt_tokens - num_computed)
            if new_block_ids:  # only table changes cross the seam
                ids.append(request_id)
                resumed.append(False)
                blocks.append(new_block_ids)
                computed.append(num_computed)
            i += 1
        step.num_prefill_tokens += prefill
        step.num_decode_tokens += start_budget - budget - prefill
        step.budget = budget

    def _allocate_or_preempt(
        self, request: Request, num_new: int, step: StepBuilder
    ) -> list[int] | None:
        """Free memory until the allocation fits (it just failed): first tables held by idle
        sessions (and finished host-tier loads not admitted yet), then preempt from the tail
        of ``running``."""
        while self._evict_holder() or self._release_kv_load(request):
            new_block_ids = self.kv.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
        while True:
            victim = self.running.pop()  # tail: lowest priority / latest (invariant)
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return None
            new_block_ids = self.kv.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids

    def _plan_images(self, request: Request, begin: int, num_new: int) -> EncoderPlan | None:
        """The encoder work of computing ``[begin, begin + num_new)`` (``core.encoder_cache``):
        a cut ``num_new`` when an image does not fit; None when no image is left to reach."""
        if not request.images or begin >= request.num_prompt_tokens:
            return None
        whole = self.encoder_only or not self.config.enable_chunked_prefill
        return self.encoder.plan(request.images, begin, num_new, whole)

    def _commit_encoder(self, request: Request, plan: EncoderPlan, step: StepBuilder) -> None:
        step.num_encoder_cache_hits += self.encoder.commit(request.request_id, plan)
        if plan.encode:
            step.encoder_inputs[request.request_id] = tuple(i for i, _ in plan.encode)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        if request.images:
            self.encoder.free_request(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token in flight still arrives: update appends it
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.prepend(request)

    def _schedule_waiting(self, step: StepBuilder) -> None:
        max_seqs = self.config.max_num_seqs
        # Skipped: their grammar is not ready yet, or their adapter would exceed --max-loras.
        skipped: list[Request] = []
        lora = self.lora
        active = None if lora is None else lora.active(self.running)
        while self.waiting and step.budget > 0 and len(self.running) < max_seqs:
            request = self.waiting.peek()
            if (
                (request.grammar is not None and not request.grammar.ready)
                or (lora is not None and active is not None and not lora.allows(request, active))
                or (
                    self.connector is not None
                    and self.connector.waiting_for_load(request.request_id)
                )
            ):  # the last: KV tiers, its blocks are being loaded (re-checked each step)
                skipped.append(self.waiting.pop())
                continue
            hit_ids: list[int]
            params = request.sampling_params
            if params.prompt_logprobs is not None or params.pooling is not None:
                hit_ids, num_hit = [], 0  # every prompt position must be computed
            else:
                hit_ids, num_hit = self.kv.get_computed_blocks(request)
                if self.connector is not None and self._start_kv_load(request, hit_ids, num_hit):
                    skipped.append(self.waiting.pop())
                    continue
            num_new = request.num_tokens - num_hit
            if num_new > step.budget and (
                self.encoder_only or not self.config.enable_chunked_prefill
            ):
                break
            num_new = min(num_new, step.budget)
            plan = self._plan_images(request, num_hit, num_new)
            if plan is not None and not (num_new := plan.num_new):
                break  # its next image does not fit this step
            new_block_ids = self.kv.allocate_slots(request, num_new, hit_ids, num_hit)
            while new_block_ids is None and (
                self._evict_holder() or self._release_kv_load(request)
            ):
                new_block_ids = self.kv.allocate_slots(request, num_new, hit_ids, num_hit)
            if new_block_ids is None:
                break
            if self.connector is not None:  # KV tiers: the request holds its loaded blocks now
                self.connector.admitted(request.request_id)
                if request.hold_as is not None:  # and its Session's host slots are unpinned
                    self.connector.unhold_session(request.hold_as)
            self.waiting.pop()
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self._admit(request, new_block_ids, step)
            if plan is not None:
                self._commit_encoder(request, plan, step)
            step.schedule(request, num_new)
            if active is not None and request.lora_request is not None:
                active.add(request.lora_int_id)
        for request in reversed(skipped):  # back in front, in their order
            self.waiting.prepend(request)

    # ------------------------------------------------------------------ KV tiers hooks
    def _start_kv_load(self, request: Request, hit_ids: list[int], num_hit: int) -> bool:
        """Ask the connector to load the blocks continuing this prefix hit; True: the request
        waits for them (its lookup is then not counted: the one after the load is)."""
        assert self.connector is not None
        bs = self.kv.block_size
        # A Session turn (its transcript likely waits in a tier): room first, other idle
        # Sessions move down before its load is cut short (its allocation would release them).
        need = -(-request.num_tokens // bs) if request.hold_as is not None else 0
        while self.kv.block_pool.num_free_blocks < need:
            if not self._evict_holder(keep=request.hold_as):
                break
        max_hit_blocks = max(0, request.num_tokens - 1) // bs
        hashes = self.kv.get_block_hashes(request.request_id)[:max_hit_blocks]
        if not self.connector.start_load(request, hashes, hit_ids):
            return False
        self.kv.prefix_cache_queries -= request.num_tokens
        self.kv.prefix_cache_hits -= num_hit
        return True

    def _release_kv_load(self, request: Request) -> bool:
        """Room for ``request``: free one other request's finished, unadmitted load."""
        return self.connector is not None and self.connector.release_ready(request.request_id)

    def _admit(self, request: Request, block_ids: list[int], step: StepBuilder) -> None:
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        if self.config.scheduling_policy == "priority":
            keys = [r.sort_key() for r in self.running]
            self.running.insert(bisect.bisect_right(keys, request.sort_key()), request)
        else:
            self.running.append(request)
        if resumed:
            step.add_cached(request, list(block_ids), resumed=True)
        else:
            step.new_reqs.append(
                NewRequestData(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    block_ids=list(block_ids),
                    num_computed_tokens=request.num_computed_tokens,
                    lora_request=request.lora_request,
                    images=request.images,
                )
            )

    def grammar_rows(self, scheduler_output: SchedulerOutput) -> list[str]:
        """The constrained requests that sample in a step just scheduled (before ``advance``):
        their rows need a mask (``late_grammar``)."""
        if self.structured is None or not self._num_constrained:
            return []
        return self.structured.sampling_rows(scheduler_output.num_scheduled_tokens, self.requests)

    # ------------------------------------------------------------------ update
    def advance(self, scheduler_output: SchedulerOutput) -> int:
        """Async scheduling: progress as if ``scheduler_output`` had run, before it runs
        (``core.placeholders``); its ``update`` then takes ``advanced=True``. The number of
        rows that sample in it."""
        return advance(self.requests, scheduler_output.num_scheduled_tokens)

    def update(
        self, scheduler_output: SchedulerOutput, model_output: ModelOutput, advanced: bool = False
    ) -> list[EngineCoreOutput]:
        requests = self.requests
        if self.connector is not None and model_output.kv_loads_done:  # KV tiers
            self.connector.loads_done(model_output.kv_loads_done, model_output.kv_load_failed)
        if not advanced:
            for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
                request = requests.get(request_id)
                if request is not None:
                    request.num_computed_tokens += num_tokens
        outputs, self._grammar_failures = self._grammar_failures, []
        any_finished = False
        logprobs = model_output.logprobs
        max_model_len = self.max_model_len
        now = time.monotonic()
        for request_id, token in zip(
            model_output.req_ids, model_output.sampled_token_ids, strict=True
        ):
            request = requests.get(request_id)
            if request is None:
                continue  # aborted while the step ran
            if advanced:
                settle(request)
            request.token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            output = EngineCoreOutput(
                request_id, [token], num_cached_tokens=request.num_cached_tokens
            )
            if logprobs and request_id in logprobs:
                output.new_logprobs = [logprobs[request_id]]
            num_tokens = len(request.token_ids)
            maybe_stop = (
                token in request.eos_token_ids
                or token in request.stop_token_ids
                or num_tokens - request.num_prompt_tokens >= request.max_tokens
                or num_tokens >= max_model_len
            )  # cheap pre-check: most decode tokens stop nothing
            grammar = request.grammar
            if grammar is not None and (not grammar.accept(token) or grammar.terminated):
                maybe_stop = True
            if maybe_stop and self._check_stop(request, token):
                any_finished = True
                output.finish_reason = request.finish_reason
                output.stop_reason = request.stop_reason
            elif request_id in scheduler_output.spec_token_ids:
                draft = scheduler_output.spec_token_ids[request_id]
                extra = model_output.extra_token_ids.get(request_id, [])
                check = self._check_stop if grammar is None else self._advance_and_check
                any_finished |= accept_drafts(request, output, draft, extra, check)
                if output.new_logprobs is not None and len(output.new_token_ids) > 1:
                    run = model_output.extra_logprobs.get(request_id, [])
                    output.new_logprobs.extend(run[: len(output.new_token_ids) - 1])
            outputs.append(output)
        if model_output.pooled:
            any_finished |= self._finish_pooled(model_output.pooled, outputs, now)
        if any_finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        if model_output.prompt_logprobs:
            self._attach_prompt_logprobs(model_output, outputs)
        return outputs

    def _finish_pooled(
        self, pooled: dict[str, list[float]], outputs: list[EngineCoreOutput], now: float
    ) -> bool:
        """Embedding requests whose prompt completed: they finish (``LENGTH``: the whole
        input was consumed) with their vector, and their blocks go back."""
        finished = False
        for request_id, vector in pooled.items():
            request = self.requests.get(request_id)
            if request is None:
                continue  # aborted while the step ran
            if request.status == RequestStatus.PREEMPTED:  # async: preempted while it ran
                self.waiting.remove(request)
            request.first_token_time = now
            self._finish(request, FinishReason.LENGTH)
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    [],
                    finish_reason=FinishReason.LENGTH,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    pooled=vector,
                )
            )
            finished = True
        return finished

    def _attach_prompt_logprobs(
        self, model_output: ModelOutput, outputs: list[EngineCoreOutput]
    ) -> None:
        by_id = {o.request_id: o for o in outputs}
        for request_id, positions in model_output.prompt_logprobs.items():
            output = by_id.get(request_id)
            if output is None:  # a prefill chunk that sampled nothing yet
                request = self.requests.get(request_id)
                if request is None:
                    continue
                output = EngineCoreOutput(request_id, [], num_cached_tokens=0)
                outputs.append(output)
            output.new_prompt_logprobs = positions

    def _advance_and_check(self, request: Request, token: int) -> bool:
        """An accepted draft of a constrained request: its matcher takes it, then the stop
        checks run (a completed grammar ends the request)."""
        assert request.grammar is not None
        request.grammar.accept(token)
        return self._check_stop(request, token)

    def _check_stop(self, request: Request, token: int) -> bool:
        """Token-level stop checks; stop strings are checked by the front's detokenizer."""
        stop = token_stop(request, token, self.max_model_len)
        if stop is None:
            return False
        if request.status == RequestStatus.PREEMPTED:  # async: preempted while its step ran
            self.waiting.remove(request)
        self._finish(request, *stop)
        return True
