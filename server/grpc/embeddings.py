"""EmbeddingService servicer: ``Embed`` (a batch of texts or token-id lists -> vectors) and
``Score`` (text pairs -> a cross-encoder's scores; its own parts in ``score``).

Each input becomes one prefill-only engine request (``SamplingParams.pooling``) with id
``<internal id>#i``, so the batch shares the scheduler, the front's admission limit
(``--max-requests``), the tenant's limits (one request slot per call, as Generate) and the
metrics / request log (one record for the call, waiting for every input's engine record).
Any failure aborts the inputs still in flight in ``finally``: no KV blocks stay behind.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc
import numpy as np
from google.protobuf.message import Message

from tokenwire.runtime.engine.protocol import EngineClient
from tokenwire.runtime.errors import ParameterError, WrongTaskError
from tokenwire.runtime.front.request_stream import RequestFailed, RequestFinished, RequestStream
from tokenwire.runtime.outputs import RequestOutput
from tokenwire.runtime.sampling_params import embedding_params
from tokenwire.server.grpc import convert
from tokenwire.server.grpc.call_context import CallContext, call_context
from tokenwire.server.grpc.errors import abort, model_not_found, to_service_error
from tokenwire.server.grpc.score import score_inputs, score_response, submit_pairs
from tokenwire.server.grpc.send_limit import check_size
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool, check_prompt_bytes
from tokenwire.server.telemetry.core import Telemetry
from tokenwire.server.telemetry.record import RequestRecord
from tokenwire.server.tenants.limits import Lease, ModelNotAllowed
from tokenwire.server.tenants.registry import TenantRegistry
from tokenwire.v1 import embeddings_pb2, embeddings_pb2_grpc

# Inputs one Embed call may carry (OpenAI's limit for /v1/embeddings).
MAX_EMBED_INPUTS = 2048
_Streams = list[tuple[str, RequestStream]]
# Submits a call's engine requests (appending their streams).
_Submit = Callable[[CallContext, _Streams], Awaitable[None]]
# The response from the call's id and its requests' final outputs, in order.
_Respond = Callable[[str, list[RequestOutput]], Message]
_REFUSES = {"embed": "it computes no embeddings", "score": "it scores no text pairs"}


class EmbeddingService(embeddings_pb2_grpc.EmbeddingServiceServicer):
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        limits: convert.Limits,
        tokenizers: TokenizerPool | None,
        telemetry: Telemetry,
        tenants: TenantRegistry | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.tokenizers = tokenizers
        self.telemetry = telemetry
        self.tenants = tenants or TenantRegistry()

    async def Embed(
        self, request: embeddings_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embeddings_pb2.EmbedResponse:
        async def submit(call: CallContext, streams: _Streams) -> None:
            await self._submit(call, request, await self._inputs(request), streams)

        def respond(request_id: str, outputs: list[RequestOutput]) -> Message:
            return _response(request_id, self.model_name, request, outputs)

        reply = await self._serve(request, context, "embed", submit, respond)
        return cast(embeddings_pb2.EmbedResponse, reply)

    async def Score(
        self, request: embeddings_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> embeddings_pb2.ScoreResponse:
        async def submit(call: CallContext, streams: _Streams) -> None:
            limit = self.limits.prompt_bytes(self.engine.info.max_model_len)
            inputs = await score_inputs(request, self.tokenizers, limit)
            submit_pairs(self.engine, call, inputs, streams)

        def respond(request_id: str, outputs: list[RequestOutput]) -> Message:
            return score_response(request_id, self.model_name, outputs)

        reply = await self._serve(request, context, "score", submit, respond)
        return cast(embeddings_pb2.ScoreResponse, reply)

    async def _serve(
        self,
        request: Any,
        context: grpc.aio.ServicerContext,
        task: str,
        submit: _Submit,
        respond: _Respond,
    ) -> Message:
        """One call's frame: tenant and model checks, admission, telemetry, the engine
        requests' outputs; any failure aborts the requests still in flight."""
        call: CallContext | None = None
        record: RequestRecord | None = None
        lease: Lease | None = None
        streams: _Streams = []
        status = "CANCELLED"
        try:
            priority = request.priority if request.HasField("priority") else None
            call = call_context(context, self.tenants, request.request_id, priority)
            record = self.telemetry.begin(call.request_id, call.internal_id, task)
            self.telemetry.set_tenant(record, call.who.name)
            self.telemetry.bind(record)
            self._check_model(call, request.model, task)
            lease = self.tenants.admit(call.who)
            await submit(call, streams)
            self.telemetry.admit(record, len(streams))
            await context.send_initial_metadata((("x-request-id", call.request_id),))
            outputs = [await final_output(stream) for _, stream in streams]
            response = respond(call.request_id, outputs)
            check_size(response, self.limits.max_response_bytes)
            status = "OK"
            return response
        except Exception as exc:
            self.telemetry.refused(exc)
            err = to_service_error(exc, call.request_id if call else None)
            status = err.code.name
            await abort(context, err)
        finally:
            for engine_id, stream in streams:  # only this call's own, unfinished inputs
                if not stream.done:
                    self.engine.abort(engine_id)
            if lease is not None:
                lease.release()
            if record is not None:
                self.telemetry.end(record, status)

    def _check_model(self, call: CallContext, name: str, task: str) -> None:
        model = name or self.model_name
        if not call.who.tenant.allows_model(model):
            raise ModelNotAllowed(call.who.name, model)
        if model != self.model_name:  # no adapters for embeddings
            raise model_not_found(model)
        info = self.engine.info
        if info.task != task:
            raise WrongTaskError(
                model,
                info.task,
                f"model {model!r} serves task {info.task!r}: {_REFUSES[task]}",
            )

    async def _inputs(self, request: embeddings_pb2.EmbedRequest) -> list[list[int]]:
        """The batch as token ids; errors name ``texts`` or ``tokens``."""
        kind = request.WhichOneof("input")
        if kind is None:
            raise ParameterError("input", "one of texts or tokens is required")
        items: list[str] | list[list[int]]
        if kind == "tokens":
            items = [list(t.ids) for t in request.tokens.inputs]
        else:
            items = list(request.texts.texts)
        if not items:
            raise ParameterError(kind, "must hold at least one input")
        if len(items) > MAX_EMBED_INPUTS:
            raise ParameterError(
                kind, f"at most {MAX_EMBED_INPUTS} inputs per call, got {len(items)}"
            )
        for i, item in enumerate(items):
            if not item:
                raise ParameterError(kind, f"input {i} is empty")
        if kind == "tokens":
            return items  # type: ignore[return-value]
        texts: list[str] = items  # type: ignore[assignment]
        if self.tokenizers is None:
            raise ParameterError("texts", "this model has no tokenizer: send tokens")
        check_prompt_bytes("texts", texts, self.limits.prompt_bytes(self.engine.info.max_model_len))
        return [await self.tokenizers.encode("texts", text) for text in texts]

    async def _submit(
        self,
        call: CallContext,
        request: embeddings_pb2.EmbedRequest,
        inputs: list[list[int]],
        streams: _Streams,
    ) -> None:
        dims = int(request.dimensions) if request.HasField("dimensions") else None
        params = embedding_params(dims)
        kind = request.WhichOneof("input") or "input"
        for i, token_ids in enumerate(inputs):
            engine_id = f"{call.internal_id}#{i}"
            try:
                stream = self.engine.add_request(
                    engine_id, None, token_ids, params, priority=call.priority
                )
            except ParameterError as exc:
                if exc.param not in ("prompt", "input"):
                    raise
                message = str(exc).removeprefix(f"{exc.param}: ")
                raise type(exc)(kind, f"input {i}: {message}") from None
            streams.append((engine_id, stream))


async def final_output(stream: RequestStream) -> RequestOutput:
    async for item in stream:
        if isinstance(item, RequestFinished):
            return item.output
        if isinstance(item, RequestFailed):
            raise item.error
    raise RuntimeError("stream ended without a final output")


def _response(
    request_id: str,
    model: str,
    request: embeddings_pb2.EmbedRequest,
    outputs: list[RequestOutput],
) -> embeddings_pb2.EmbedResponse:
    as_bytes = request.encoding == embeddings_pb2.EMBEDDING_ENCODING_BYTES
    data = []
    total = 0
    for i, output in enumerate(outputs):
        vector = output.embedding or []
        tokens = len(output.prompt_token_ids)
        total += tokens
        item = embeddings_pb2.Embedding(index=i, prompt_tokens=tokens)
        if as_bytes:
            item.data = np.asarray(vector, dtype="<f4").tobytes()
        else:
            item.values.extend(vector)
        data.append(item)
    dims = len(outputs[0].embedding or []) if outputs else 0
    return embeddings_pb2.EmbedResponse(
        request_id=request_id,
        model=model,
        data=data,
        usage=embeddings_pb2.EmbeddingUsage(prompt_tokens=total, total_tokens=total),
        dimensions=dims,
    )
