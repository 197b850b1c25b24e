"""``update()``: the only place where request progress advances (``SchedulerUpdate``, on
``SchedulerBase``): a step's sampled tokens appended, stop checks, speculative drafts accepted,
constrained requests' matchers advanced, embedding requests finished with their vectors,
prompt logprobs attached. Async scheduling's ``advance`` runs the progress ahead of the step.
Imports no torch.
"""

from __future__ import annotations

import time

from tokenwire.runtime.core.placeholders import advance, settle
from tokenwire.runtime.core.request import Request, RequestStatus
from tokenwire.runtime.core.scheduler_base import SchedulerBase
from tokenwire.runtime.core.spec.accept import accept_drafts
from tokenwire.runtime.core.stop_check import token_stop
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.outputs import EngineCoreOutput, FinishReason
from tokenwire.runtime.scheduler_output import SchedulerOutput


class SchedulerUpdate(SchedulerBase):
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
        self._step_ran(scheduler_output, model_output, advanced)
        requests = self.requests
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

    def _step_ran(
        self, scheduler_output: SchedulerOutput, model_output: ModelOutput, advanced: bool
    ) -> None:
        """What a step did besides sampling: KV-tier loads it completed, and (unless
        ``advance`` ran ahead of it) the tokens it computed."""
        if self.connector is not None and model_output.kv_loads_done:  # KV tiers
            self.connector.loads_done(model_output.kv_loads_done, model_output.kv_load_failed)
        if not advanced:
            requests = self.requests
            for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
                request = requests.get(request_id)
                if request is not None:
                    request.num_computed_tokens += num_tokens

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
