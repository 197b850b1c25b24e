"""tokenwire's stream items -> ``vllm.grpc.engine`` GenerateResponse messages, as vLLM's own
servicer shapes them (the gateway detokenizes, so only token ids travel).

Streaming (``stream: true``): one ``chunk`` per output delta of a choice (its new token ids,
their logprobs, ``completion_tokens`` = the delta's length: the gateway adds them up), then,
once the request finished, a ``complete`` per choice carrying its last delta's ids as vLLM's
does. Unary: one ``complete`` per choice once the whole request finished, in index order,
with every token id. Finish reasons are vLLM's: "stop" (EOS, a stop token or string), "length"
(max_tokens, the context, a time limit), "abort" (cancelled), "error"; the matched stop string
or stop token id rides in ``matched_stop``. Prompt logprobs (tokenwire has them only once the
request finished) ride in each ``complete``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from smg_grpc_proto.generated import vllm_engine_pb2

from tokenwire.runtime.outputs import ChoiceDelta, FinishReason, PositionLogprobs

_FINISH = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.GRAMMAR_END: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT_LENGTH: "length",
    FinishReason.TIME_LIMIT: "length",
    FinishReason.CANCELLED: "abort",
    FinishReason.ERROR: "error",
}


def finish_reason(reason: FinishReason | None) -> str:
    return "stop" if reason is None else _FINISH[reason]


def output_logprobs(
    positions: list[PositionLogprobs] | None, num_top: int | None
) -> vllm_engine_pb2.OutputLogProbs | None:
    """Chosen token's logprob per position, and the top ``num_top`` by rank."""
    if not positions or num_top is None:
        return None
    out = vllm_engine_pb2.OutputLogProbs()
    for position in positions:
        chosen_id, chosen = next(iter(position.items()))
        out.token_ids.append(chosen_id)
        out.token_logprobs.append(chosen.logprob)
        if num_top > 0:
            out.top_logprobs.append(_top(position, num_top))
    return out


def input_logprobs(
    positions: list[PositionLogprobs | None] | None,
    prompt_token_ids: list[int],
    num_top: int | None,
) -> vllm_engine_pb2.InputLogProbs | None:
    """Per prompt token: its logprob (none for the first) and the top ``num_top``."""
    if not positions or num_top is None:
        return None
    out = vllm_engine_pb2.InputLogProbs()
    for token_id, position in zip(prompt_token_ids, positions, strict=False):
        value = vllm_engine_pb2.InputTokenLogProb()
        if position is not None and token_id in position:
            value.value = position[token_id].logprob
        out.token_logprobs.append(value)
        out.token_ids.append(token_id)
        if num_top > 0:
            out.top_logprobs.append(
                _top(position, num_top) if position else vllm_engine_pb2.TopLogProbs()
            )
    return out


def _top(position: PositionLogprobs, num_top: int) -> vllm_engine_pb2.TopLogProbs:
    ranked = sorted(
        (item for item in position.items() if item[1].rank is not None and item[1].rank <= num_top),
        key=lambda item: item[1].rank or 0,
    )
    return vllm_engine_pb2.TopLogProbs(
        token_ids=[token_id for token_id, _ in ranked], values=[lp.logprob for _, lp in ranked]
    )


def _matched_stop(stop_reason: int | str | None) -> dict[str, int | str]:
    if isinstance(stop_reason, str):
        return {"matched_stop_str": stop_reason}
    if isinstance(stop_reason, int):
        return {"matched_token_id": stop_reason}
    return {}


@dataclass
class ChoiceState:
    """What one choice produced so far (the unary answer needs all of it)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    last_ids: list[int] = field(default_factory=list)  # the latest delta's (streaming)
    last_logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass
class ResponseShaper:
    """Turns one request's deltas into response messages (streaming or unary)."""

    stream: bool
    num_top: int | None  # sampling_params.logprobs (None: not asked)
    prompt_top: int | None  # sampling_params.prompt_logprobs
    prompt_tokens: int = 0
    cached_tokens: int = 0
    choices: dict[int, ChoiceState] = field(default_factory=dict)

    def started(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens

    def delta(self, item: ChoiceDelta) -> list[vllm_engine_pb2.GenerateResponse]:
        state = self.choices.setdefault(item.index, ChoiceState())
        state.token_ids.extend(item.token_ids)
        state.logprobs.extend(item.logprobs or ())
        state.last_ids, state.last_logprobs = list(item.token_ids), item.logprobs
        if item.finish_reason is not None:
            state.finish_reason, state.stop_reason = item.finish_reason, item.stop_reason
        if not self.stream:
            return []
        chunk = vllm_engine_pb2.GenerateStreamChunk(
            token_ids=item.token_ids,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(item.token_ids),
            cached_tokens=self.cached_tokens,
            index=item.index,
        )
        logprobs = output_logprobs(item.logprobs, self.num_top)
        if logprobs is not None:
            chunk.output_logprobs.CopyFrom(logprobs)
        return [vllm_engine_pb2.GenerateResponse(chunk=chunk)]

    def final(
        self, prompt: vllm_engine_pb2.InputLogProbs | None
    ) -> list[vllm_engine_pb2.GenerateResponse]:
        """One ``complete`` per choice, in index order: streamed, its last delta's ids (the
        gateway has the rest); unary, every token id."""
        out = []
        for index, state in sorted(self.choices.items()):
            if self.stream:
                out.append(self._complete(index, state.last_ids, state.last_logprobs, prompt))
            else:
                out.append(self._complete(index, state.token_ids, state.logprobs, prompt))
        return out

    def _complete(
        self,
        index: int,
        token_ids: list[int],
        logprobs: list[PositionLogprobs] | None,
        prompt: vllm_engine_pb2.InputLogProbs | None,
    ) -> vllm_engine_pb2.GenerateResponse:
        state = self.choices[index]
        complete = vllm_engine_pb2.GenerateComplete(
            output_ids=token_ids,
            finish_reason=finish_reason(state.finish_reason),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(token_ids),
            cached_tokens=self.cached_tokens,
            index=index,
            **_matched_stop(state.stop_reason),
        )
        out = output_logprobs(logprobs, self.num_top)
        if out is not None:
            complete.output_logprobs.CopyFrom(out)
        if prompt is not None:
            complete.input_logprobs.CopyFrom(prompt)
        return vllm_engine_pb2.GenerateResponse(complete=complete)
