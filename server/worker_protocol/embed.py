"""``VllmEngine.Embed``: one tokenized input in, its pooled embedding out (vLLM's engine
protocol; SMG sends ``/v1/embeddings`` to gRPC workers this way).

The call discipline of ``Generate``: the caller's tenant scopes the request id and holds a
request slot, the engine validates before anything is queued, and the abort in ``finally``
frees the KV blocks of a cancelled or failed call. A generation model answers
FAILED_PRECONDITION (``WRONG_TASK``) as tokenwire's own ``EmbeddingService`` does.
"""

from __future__ import annotations

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2

from tokenwire.runtime.engine.protocol import EngineClient
from tokenwire.runtime.errors import ParameterError, WrongTaskError
from tokenwire.runtime.front.request_stream import RequestStream
from tokenwire.runtime.sampling_params import embedding_params
from tokenwire.server.grpc.call_context import CallContext, call_context
from tokenwire.server.grpc.embeddings import final_output
from tokenwire.server.grpc.errors import abort, to_service_error
from tokenwire.server.telemetry.core import Telemetry
from tokenwire.server.telemetry.record import RequestRecord
from tokenwire.server.tenants.limits import Lease, ModelNotAllowed
from tokenwire.server.tenants.registry import TenantRegistry

KIND = "vllm_embed"


class WorkerEmbed:
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        telemetry: Telemetry,
        tenants: TenantRegistry,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.telemetry = telemetry
        self.tenants = tenants

    async def __call__(
        self, request: vllm_engine_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.EmbedResponse:
        call: CallContext | None = None
        stream: RequestStream | None = None
        record: RequestRecord | None = None
        lease: Lease | None = None
        status = "CANCELLED"
        try:
            call = call_context(context, self.tenants, request.request_id)
            record = self.telemetry.begin(call.request_id, call.internal_id, KIND)
            self.telemetry.set_tenant(record, call.who.name)
            self.telemetry.bind(record)
            self._check(call)
            lease = self.tenants.admit(call.who)
            token_ids = list(request.tokenized.input_ids)
            if not token_ids:
                raise ParameterError("tokenized.input_ids", "must hold at least one token")
            stream = self.engine.add_request(
                call.internal_id, None, token_ids, embedding_params(None), priority=call.priority
            )
            self.telemetry.admit(record, 1)
            output = await final_output(stream)
            vector = output.embedding or []
            status = "OK"
            return vllm_engine_pb2.EmbedResponse(
                embedding=vector,
                prompt_tokens=len(output.prompt_token_ids),
                embedding_dim=len(vector),
            )
        except Exception as exc:
            if isinstance(exc, ParameterError) and exc.param in ("prompt", "input"):
                exc = ParameterError("tokenized.input_ids", str(exc).removeprefix(f"{exc.param}: "))
            self.telemetry.refused(exc)
            err = to_service_error(exc, call.request_id if call else None)
            status = err.code.name
            await abort(context, err)
        finally:
            if call is not None and stream is not None and not stream.done:
                self.engine.abort(call.internal_id)
            if lease is not None:
                lease.release()
            if record is not None:
                self.telemetry.end(record, status)

    def _check(self, call: CallContext) -> None:
        if not call.who.tenant.allows_model(self.model_name):
            raise ModelNotAllowed(call.who.name, self.model_name)
        info = self.engine.info
        if info.embed is None:
            raise WrongTaskError(
                self.model_name,
                info.task,
                f"model {self.model_name!r} serves task {info.task!r}: it computes no embeddings",
            )
