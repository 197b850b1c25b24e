"""``VllmEngine.Generate``: token ids in, token ids (and logprobs, finish reasons) out.

The same call discipline as ``tokenwire.v1`` generation: the caller's tenant (API key) scopes
the request id and holds a request slot, the engine validates the request before anything is
queued, and the engine abort sits in ``finally`` so a cancelled, disconnected or failed call
always frees its KV blocks. Every failure is a status with ``google.rpc`` details; a bad field
is INVALID_ARGUMENT naming the proto field.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2

from tokenwire.runtime.engine.protocol import EngineClient
from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.request_stream import RequestFinished, RequestStream
from tokenwire.runtime.outputs import ChoiceDelta, RequestStarted
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.server.grpc.call_context import CallContext, call_context
from tokenwire.server.grpc.convert import Limits
from tokenwire.server.grpc.errors import abort, to_service_error
from tokenwire.server.grpc.send_limit import check_size
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool
from tokenwire.server.telemetry.core import Telemetry
from tokenwire.server.telemetry.record import RequestRecord
from tokenwire.server.tenants.limits import Lease, ModelNotAllowed
from tokenwire.server.tenants.registry import TenantRegistry
from tokenwire.server.worker_protocol import requests
from tokenwire.server.worker_protocol.responses import ResponseShaper, input_logprobs

Responses = AsyncIterator[vllm_engine_pb2.GenerateResponse]
KIND = "vllm_generate"


class WorkerGenerate:
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        limits: Limits,
        tokenizers: TokenizerPool | None,
        telemetry: Telemetry,
        tenants: TenantRegistry,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.tokenizers = tokenizers
        self.telemetry = telemetry
        self.tenants = tenants

    async def __call__(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> Responses:
        call: CallContext | None = None
        stream: RequestStream | None = None
        record: RequestRecord | None = None
        lease: Lease | None = None
        status = "CANCELLED"  # unless the body completes or fails
        try:
            call = call_context(context, self.tenants, request.request_id)
            record = self.telemetry.begin(call.request_id, call.internal_id, KIND)
            self.telemetry.set_tenant(record, call.who.name)
            self.telemetry.bind(record)
            if not call.who.tenant.allows_model(self.model_name):
                raise ModelNotAllowed(call.who.name, self.model_name)
            lease = self.tenants.admit(call.who)
            stream, params = await self._submit(call, request, record)
            async for message in self._responses(stream, params, request.stream, lease):
                check_size(message, self.limits.max_response_bytes)
                yield message
            status = "OK"
        except Exception as exc:
            if isinstance(exc, ParameterError):
                exc = requests.in_proto_terms(exc, request.WhichOneof("input") or "tokenized")
            self.telemetry.refused(exc)
            err = to_service_error(exc, call.request_id if call else None)
            status = err.code.name
            await abort(context, err)
        finally:
            if call is not None and stream is not None and not stream.done:
                self.engine.abort(call.internal_id)  # frees its KV blocks
            if lease is not None:
                lease.release()
            if record is not None:
                self.telemetry.end(record, status)

    async def _prompt(self, request: vllm_engine_pb2.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "tokenized":
            ids = list(request.tokenized.input_ids)
            return requests.truncated(ids, request.sampling_params, self.engine.info.max_model_len)
        if kind == "text":
            if self.tokenizers is None:
                raise ParameterError("text", "this model has no tokenizer: send tokenized")
            if not request.text:
                raise ParameterError("text", "must not be empty")
            ids = await self.tokenizers.encode("text", request.text)
            return requests.truncated(ids, request.sampling_params, self.engine.info.max_model_len)
        raise ParameterError("tokenized", "one of tokenized or text is required")

    async def _submit(
        self,
        call: CallContext,
        request: vllm_engine_pb2.GenerateRequest,
        record: RequestRecord,
    ) -> tuple[RequestStream, SamplingParams]:
        requests.check_unsupported(request)
        token_ids = await self._prompt(request)
        params = requests.sampling_params(
            request.sampling_params, self.limits, self.engine.info.default_sampling
        )
        self.telemetry.describe(record, params, False, None)
        await self.engine.check_constraint(params)  # grammar work off the event loop
        stream = self.engine.add_request(
            call.internal_id,
            None,
            token_ids,
            params,
            priority=call.priority,
            cache_salt=call.who.cache_salt(None),
            data_parallel_rank=(
                request.data_parallel_rank if request.HasField("data_parallel_rank") else None
            ),
        )
        self.telemetry.admit(record, params.n)
        return stream, params

    async def _responses(
        self, stream: RequestStream, params: SamplingParams, streaming: bool, lease: Lease
    ) -> Responses:
        shaper = ResponseShaper(streaming, params.logprobs, params.prompt_logprobs)
        async for item in stream:
            if isinstance(item, RequestStarted):
                shaper.started(item.num_prompt_tokens, item.num_cached_tokens)
            elif isinstance(item, ChoiceDelta):
                lease.charge(len(item.token_ids))
                for message in shaper.delta(item):
                    yield message
            elif isinstance(item, RequestFinished):
                output = item.output
                shaper.started(len(output.prompt_token_ids), output.num_cached_tokens)
                prompt = input_logprobs(
                    output.prompt_logprobs, output.prompt_token_ids, params.prompt_logprobs
                )
                for message in shaper.final(prompt):
                    yield message
                return
            else:
                raise item.error
