"""Front-end output processing: ``n > 1`` fan-out, detokenization, stop strings, logprobs.

Lives in the server process (as in vLLM v1): the engine core produces token ids only. For
each step it turns ``EngineCoreOutput``s into per-choice deltas, reports which child
requests matched a stop string (the caller aborts them in the engine), and assembles the
final ``RequestOutput`` once every choice of a request has finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenwire.runtime.front.detokenizer import IncrementalDetokenizer, decode_token
from tokenwire.runtime.front.tokenizer import Tokenizer
from tokenwire.runtime.model_output import TokenLogprobs
from tokenwire.runtime.outputs import (
    ChoiceDelta,
    CompletionOutput,
    EngineCoreOutput,
    FinishReason,
    Logprob,
    PositionLogprobs,
    RequestOutput,
    RequestStarted,
)
from tokenwire.runtime.sampling_params import SamplingParams


@dataclass(slots=True)
class ProcessedStep:
    started: list[RequestStarted] = field(default_factory=list)
    deltas: list[ChoiceDelta] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)
    # Child request ids that matched a stop string: the caller must abort them in the engine.
    to_abort: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Choice:
    parent: _Parent
    index: int
    child_id: str
    detokenizer: IncrementalDetokenizer | None
    include_stop: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    text: str = ""


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_unfinished: int = 0
    started: bool = False
    embedding: list[float] | None = None


# Reasons whose last token is a stop token, not content (``GRAMMAR_END``'s last is content).
_TOKEN_STOPS = (FinishReason.EOS, FinishReason.STOP_TOKEN)


def child_request_id(request_id: str, index: int, n: int) -> str:
    """Engine-side id of choice ``index``; ``n == 1`` keeps the caller's id unchanged."""
    return request_id if n == 1 else f"{request_id}#{index}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Choice] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> list[tuple[str, SamplingParams]]:
        """Register a request; returns the (child id, params) pairs to add to the engine.

        Child ``i`` of a seeded request uses ``seed + i`` so choices differ but stay
        reproducible; children share the prompt's KV blocks through prefix caching.
        """
        parent = _Parent(
            request_id, prompt, list(prompt_token_ids), params, num_unfinished=params.n
        )
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = []
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else (params.seed + i) % (2**63)
            child_params = params if params.n == 1 else params.with_seed(seed)
            child_id = child_request_id(request_id, i, params.n)
            detok = None
            if self.tokenizer is not None and params.pooling is None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child_params)
            choice = _Choice(parent, i, child_id, detok, params.include_stop_str_in_output)
            if params.logprobs is not None:
                choice.logprobs, choice.cumulative_logprob = [], 0.0
            parent.choices.append(choice)
            self._children[child_id] = choice
            children.append((child_id, child_params))
        self._parents[request_id] = parent
        return children

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its unfinished child ids (to abort in the engine)."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        for choice in parent.choices:
            self._children.pop(choice.child_id, None)
        return [c.child_id for c in parent.choices if c.finish_reason is None]

    def parent_of(self, child_id: str) -> str | None:
        """The request id of an engine-side choice id still being tracked."""
        choice = self._children.get(child_id)
        return None if choice is None else choice.parent.request_id

    def unfinished_children(self, request_id: str) -> list[str]:
        """Engine-side ids of the request's choices that are still generating."""
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        return [c.child_id for c in parent.choices if c.finish_reason is None]

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ------------------------------------------------------------------ per step
    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedStep:
        step = ProcessedStep()
        for output in outputs:
            choice = self._children.get(output.request_id)
            if choice is None or choice.finish_reason is not None:
                continue  # aborted, or already finished by a stop string
            parent = choice.parent
            if not parent.started:
                parent.started = True
                step.started.append(
                    RequestStarted(
                        parent.request_id, len(parent.prompt_token_ids), output.num_cached_tokens
                    )
                )
            if choice.index == 0:
                parent.num_cached_tokens = output.num_cached_tokens
                if output.new_prompt_logprobs is not None:
                    self._add_prompt_logprobs(parent, output.new_prompt_logprobs)
                if output.pooled is not None:
                    parent.embedding = output.pooled
            delta = self._advance(choice, output)
            if choice.finish_reason == FinishReason.STOP_SEQUENCE and not output.finished:
                step.to_abort.append(choice.child_id)
            if delta is not None:
                step.deltas.append(delta)
            if choice.finish_reason is not None:
                parent.num_unfinished -= 1
                if parent.num_unfinished == 0:
                    step.finished.append(self._finish_parent(parent))
        return step

    def _advance(self, choice: _Choice, output: EngineCoreOutput) -> ChoiceDelta | None:
        new_ids = output.new_token_ids
        choice.token_ids.extend(new_ids)
        logprobs = self._convert_logprobs(choice, output.new_logprobs)
        text = ""
        detok = choice.detokenizer
        if detok is not None:
            # As vLLM: the EOS / stop token that ends a choice is not turned into text.
            to_decode = new_ids
            if output.finish_reason in _TOKEN_STOPS and not choice.include_stop:
                to_decode = new_ids[:-1]
            text = detok.update(to_decode) if to_decode else ""
            if detok.stop_matched is not None:
                choice.finish_reason = FinishReason.STOP_SEQUENCE
                choice.stop_reason = detok.stop_matched
            elif output.finish_reason is not None:
                text += detok.flush()
        if choice.finish_reason is None and output.finish_reason is not None:
            choice.finish_reason = output.finish_reason
            choice.stop_reason = output.stop_reason
        choice.text += text
        if not new_ids and choice.finish_reason is None:
            return None
        return ChoiceDelta(
            choice.parent.request_id,
            choice.index,
            text,
            list(new_ids),
            logprobs,
            choice.finish_reason,
            choice.stop_reason,
        )

    def _convert_logprobs(
        self, choice: _Choice, new: list[TokenLogprobs] | None
    ) -> list[PositionLogprobs] | None:
        if new is None or choice.logprobs is None:
            return None
        converted = [self._position(entry) for entry in new]
        choice.logprobs.extend(converted)
        assert choice.cumulative_logprob is not None
        choice.cumulative_logprob += sum(entry.logprobs[0] for entry in new)
        return converted

    def _position(self, entry: TokenLogprobs) -> PositionLogprobs:
        """Chosen token first (with its true rank), then alternatives ranked 1..k."""
        position: PositionLogprobs = {}
        for k, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs, strict=True)):
            if token_id in position:
                continue  # the chosen token is also among the top-k
            rank = entry.rank if k == 0 else k
            text = None if self.tokenizer is None else decode_token(self.tokenizer, token_id)
            position[token_id] = Logprob(logprob, rank, text)
        return position

    def _add_prompt_logprobs(self, parent: _Parent, positions: list[TokenLogprobs | None]) -> None:
        assert parent.prompt_logprobs is not None
        parent.prompt_logprobs.extend(None if p is None else self._position(p) for p in positions)

    def _finish_parent(self, parent: _Parent) -> RequestOutput:
        del self._parents[parent.request_id]
        outputs = []
        for choice in parent.choices:
            self._children.pop(choice.child_id, None)
            outputs.append(
                CompletionOutput(
                    index=choice.index,
                    text=choice.text,
                    token_ids=choice.token_ids,
                    cumulative_logprob=choice.cumulative_logprob,
                    logprobs=choice.logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=parent.prompt_logprobs,
            finished=True,
            embedding=parent.embedding,
        )
