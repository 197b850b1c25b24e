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

from tokenwire.runtime.core.encoder_cache import EncoderPlan
from tokenwire.runtime.core.placeholders import finishes_by_length
from tokenwire.runtime.core.request import Request, RequestStatus
from tokenwire.runtime.core.scheduler_update import SchedulerUpdate
from tokenwire.runtime.core.step_builder import StepBuilder
from tokenwire.runtime.outputs import FinishReason
from tokenwire.runtime.scheduler_output import NewRequestData, SchedulerOutput
from tokenwire.runtime.structured.manager import failure_output


class Scheduler(SchedulerUpdate):
    """``schedule()`` on the scheduler's state (``scheduler_base``) and ``update()``
    (``scheduler_update``)."""

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
            self._start_waiting(request, num_hit, num_new, new_block_ids, plan, step)
            if active is not None and request.lora_request is not None:
                active.add(request.lora_int_id)
        for request in reversed(skipped):  # back in front, in their order
            self.waiting.prepend(request)

    def _start_waiting(
        self,
        request: Request,
        num_hit: int,
        num_new: int,
        block_ids: list[int],
        plan: EncoderPlan | None,
        step: StepBuilder,
    ) -> None:
        """The head of the queue, its blocks allocated, runs from this step: its prefix hit
        counts as computed, ``num_new`` tokens (and its images' encoder work) are scheduled."""
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
        self._admit(request, block_ids, step)
        if plan is not None:
            self._commit_encoder(request, plan, step)
        step.schedule(request, num_new)

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
