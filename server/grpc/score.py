"""``EmbeddingService.Score``'s own parts: text pairs -> token ids, one engine request per
pair, the response. The call's frame (tenant, admission, telemetry, aborts in ``finally``)
is ``EmbeddingService``'s, as for ``Embed``.

Pairing and its bound (``MAX_SCORE_PAIRS``) are ``runtime.front.score_pairs``'s: one text_1
against every text_2, or equal-length lists by index; errors name ``text_1`` / ``text_2``.
"""

from __future__ import annotations

from tokenwire.runtime.engine.protocol import EngineClient
from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.request_stream import RequestStream
from tokenwire.runtime.front.score_pairs import encode_pair, pair_texts, score_params
from tokenwire.runtime.outputs import RequestOutput
from tokenwire.server.grpc.call_context import CallContext
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool, check_prompt_bytes
from tokenwire.v1 import embeddings_pb2

# (token ids, where the second text starts) per pair.
PairInputs = list[tuple[list[int], int]]


async def score_inputs(
    request: embeddings_pb2.ScoreRequest, tokenizers: TokenizerPool | None, max_prompt_bytes: int
) -> PairInputs:
    """The pairs tokenized; ParameterError naming ``text_1`` / ``text_2``."""
    pairs = pair_texts(list(request.text_1), list(request.text_2))
    if tokenizers is None:
        raise ParameterError("text_1", "this model has no tokenizer: it cannot score texts")
    check_prompt_bytes("text_1", list(request.text_1), max_prompt_bytes)
    check_prompt_bytes("text_2", list(request.text_2), max_prompt_bytes)
    return [
        await tokenizers.run(encode_pair, tokenizers.tokenizer, first, second)
        for first, second in pairs
    ]


def submit_pairs(
    engine: EngineClient,
    call: CallContext,
    inputs: PairInputs,
    streams: list[tuple[str, RequestStream]],
) -> None:
    """One prefill-only engine request per pair, ``<internal id>#i``; a pair the engine
    refuses (too long) is named ``text_2``."""
    for i, (token_ids, start) in enumerate(inputs):
        engine_id = f"{call.internal_id}#{i}"
        try:
            stream = engine.add_request(
                engine_id, None, token_ids, score_params(start), priority=call.priority
            )
        except ParameterError as exc:
            if exc.param not in ("prompt", "input"):
                raise
            message = str(exc).removeprefix(f"{exc.param}: ")
            raise type(exc)("text_2", f"pair {i}: {message}") from None
        streams.append((engine_id, stream))


def score_response(
    request_id: str, model: str, outputs: list[RequestOutput]
) -> embeddings_pb2.ScoreResponse:
    data = []
    total = 0
    for i, output in enumerate(outputs):
        tokens = len(output.prompt_token_ids)
        total += tokens
        score = (output.embedding or [0.0])[0]
        data.append(embeddings_pb2.PairScore(index=i, score=score, prompt_tokens=tokens))
    return embeddings_pb2.ScoreResponse(
        request_id=request_id,
        model=model,
        data=data,
        usage=embeddings_pb2.EmbeddingUsage(prompt_tokens=total, total_tokens=total),
    )
