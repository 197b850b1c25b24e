"""GenerationService servicer: Generate, GenerateStream, Cancel (Session lives beside it).

Thin: parse -> ``EngineClient.add_request`` -> translate stream items. The engine abort sits
in ``finally`` so a cancelled, expired or failed call always frees its KV blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from tokenwire.runtime.engine.protocol import EngineClient
from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.request_stream import RequestFinished, RequestStream
from tokenwire.runtime.outputs import ChoiceDelta, RequestStarted
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.server.grpc import convert
from tokenwire.server.grpc.adapters import resolve_model
from tokenwire.server.grpc.call_context import CallContext, call_context, caller_of
from tokenwire.server.grpc.call_context import internal_request_id as internal_id
from tokenwire.server.grpc.errors import abort, renamed, to_service_error
from tokenwire.server.grpc.generation_events import choice_message, delta_events, final_output
from tokenwire.server.grpc.request_options import retained_holder
from tokenwire.server.grpc.send_limit import check_size
from tokenwire.server.grpc.session import SessionHandler
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool
from tokenwire.server.grpc.tools import (
    ChatTooling,
    chat_tooling,
)
from tokenwire.server.telemetry.core import Telemetry
from tokenwire.server.telemetry.record import RequestRecord
from tokenwire.server.tenants.limits import Lease, ModelNotAllowed
from tokenwire.server.tenants.registry import TenantRegistry
from tokenwire.server.tool_parsers.auto_constraint import auto_constraint
from tokenwire.server.tool_parsers.output import ChoiceParser, OutputParsing
from tokenwire.v1 import generation_pb2, generation_pb2_grpc

Events = AsyncIterator[generation_pb2.GenerateStreamResponse]


@dataclass(frozen=True, slots=True)
class _Submitted:
    """A call whose request the engine accepted."""

    call: CallContext
    stream: RequestStream
    num_top: int | None
    prompt_top: int | None  # OutputOptions.prompt_logprobs (None: not asked)
    record: RequestRecord
    parsing: OutputParsing | None  # reasoning / tool calls to read out of the text
    model: str  # the request's model: the served model's name or a LoRA adapter's
    lease: Lease  # the tenant's request slot: generated tokens are charged to it


@dataclass(frozen=True)
class OutputReaders:
    """Server flags: ``--tool-call-parser`` and ``--reasoning-parser`` (None: off)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


class GenerationService(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        limits: convert.Limits,
        tokenizers: TokenizerPool | None,
        sessions: SessionHandler,
        telemetry: Telemetry,
        readers: OutputReaders | None = None,
        tenants: TenantRegistry | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.tokenizers = tokenizers
        self.sessions = sessions
        self.telemetry = telemetry
        self.readers = readers or OutputReaders()
        self.tenants = tenants or TenantRegistry()

    def _shape(
        self, tooling: ChatTooling | None, params: SamplingParams
    ) -> tuple[SamplingParams, OutputParsing | None]:
        """Chat tools: the grammar of a required / named tool choice joins the params, and
        how to read the output (tool calls, reasoning) is decided."""
        if tooling is None:
            return params, None
        auto = tooling.choice is not None and tooling.choice.mode == "auto"
        if auto and params.structured_outputs is None:  # arguments held to the schema
            parser = self.readers.tool_call_parser
            constraint = auto_constraint(parser, tooling.tools, tooling.parallel)
            if constraint is not None:
                params = dataclasses.replace(params, structured_outputs=constraint)
        if tooling.constraint is not None:
            if params.structured_outputs is not None:
                raise ParameterError(
                    "tool_choice",
                    "a required or named tool choice cannot be combined with structured_output",
                )
            params = dataclasses.replace(params, structured_outputs=tooling.constraint)
        try:
            parsing = tooling.parsing(self.readers.tool_call_parser, self.readers.reasoning_parser)
        except ParameterError as exc:  # "auto" without a parser: name what the client sent
            raise (exc if tooling.choice_explicit else renamed(exc, "tools")) from None
        if parsing.needs_special_tokens:  # Harmony's channels are special tokens
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params, parsing if parsing.active else None

    async def _submit(
        self, call: CallContext, request: generation_pb2.GenerateRequest, record: RequestRecord
    ) -> tuple[RequestStream, SamplingParams, OutputParsing | None]:
        lora = resolve_model(self.engine, self.model_name, request.model)
        self.telemetry.select_model(record, lora.lora_name if lora else self.model_name)
        chat = request.WhichOneof("input") == "chat"
        tooling = chat_tooling(request.chat) if chat else None
        salt = call.who.cache_salt(request.cache_salt or None)
        prompt, token_ids, images = await convert.tokenize_input(
            self.tokenizers, request, tooling, salt
        )
        kept = convert.truncate_prompt(request, token_ids, self.engine.info.max_model_len)
        if len(kept) < len(token_ids):  # the text no longer matches the ids
            if images:
                raise ParameterError(
                    "truncate_prompt_tokens", "cannot cut a prompt that has images"
                )
            prompt, token_ids = None, kept
        params = convert.sampling_params(
            request.sampling,
            request.stopping,
            request.output,
            self.limits,
            self.engine.info.default_sampling,
            constrained=tooling is not None and tooling.constraint is not None,
        )
        asked = params.structured_outputs  # the client's own constraint (None: none)
        params, parsing = self._shape(tooling, params)
        self.telemetry.describe(record, params, chat, prompt)
        try:
            await self.engine.check_constraint(params)  # grammar work off the event loop
            stream = self.engine.add_request(
                call.internal_id,
                prompt,
                token_ids,
                params,
                priority=call.priority,  # clamped to the tenant's max_priority
                cache_salt=salt,
                hold_as=retained_holder(call.caller, request.retain_kv_as),
                lora_request=lora,
                images=images,
            )
        except ParameterError as exc:
            constrained_by_tools = params.structured_outputs is not asked
            if constrained_by_tools and exc.param.startswith("structured_outputs"):
                raise renamed(exc, "tools") from None  # a tool's parameters schema
            if exc.param != "prompt":
                raise
            # The engine says "prompt"; the client sent it as this field of ``input``.
            field = request.WhichOneof("input") or "input"
            raise type(exc)(field, str(exc).removeprefix("prompt: ")) from None
        self.telemetry.admit(record, params.n)
        return stream, params, parsing

    @contextlib.asynccontextmanager
    async def _request(
        self, context: grpc.aio.ServicerContext, request: generation_pb2.GenerateRequest, kind: str
    ) -> AsyncIterator[_Submitted]:
        """One Generate/GenerateStream call around its body: submit, then map any failure to
        its gRPC status, abort the engine request if unfinished, close the telemetry record."""
        call: CallContext | None = None
        stream: RequestStream | None = None
        record: RequestRecord | None = None
        lease: Lease | None = None
        status = "CANCELLED"  # unless the body completes or fails
        try:
            typed_priority = request.priority if request.HasField("priority") else None
            call = call_context(context, self.tenants, request.request_id, typed_priority)
            record = self.telemetry.begin(call.request_id, call.internal_id, kind)
            self.telemetry.set_tenant(record, call.who.name)
            self.telemetry.bind(record)
            model = request.model or self.model_name  # resolved: the base or an adapter
            if not call.who.tenant.allows_model(model):
                raise ModelNotAllowed(call.who.name, model)
            lease = self.tenants.admit(call.who)  # the tenant's limits, before the engine's
            stream, params, parsing = await self._submit(call, request, record)
            await context.send_initial_metadata((("x-request-id", call.request_id),))
            yield _Submitted(
                call, stream, params.logprobs, params.prompt_logprobs, record, parsing, model, lease
            )
            status = "OK"
        except Exception as exc:
            self.telemetry.refused(exc)
            err = to_service_error(exc, call.request_id if call else None)
            status = err.code.name
            await abort(context, err)
        finally:
            # Only this call's own, unfinished request: never an in-flight one with the same
            # id that made this call fail as a duplicate.
            if call is not None and stream is not None and not stream.done:
                self.engine.abort(call.internal_id)
                holder = retained_holder(call.caller, request.retain_kv_as)
                if holder is not None:  # a failed or abandoned call keeps no KV
                    self.engine.release_holder(holder)
            if lease is not None:
                lease.release()
            if record is not None:
                self.telemetry.end(record, status)

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GenerateResponse:
        async with self._request(context, request, "generate") as sub:
            output = await final_output(sub.stream, sub.lease)
            self.telemetry.record_completion(sub.record, [c.text for c in output.outputs])
            response = generation_pb2.GenerateResponse(
                request_id=sub.call.request_id,
                model=sub.model,
                choices=[choice_message(c, sub.num_top, sub.parsing) for c in output.outputs],
                usage=convert.usage(output),
                prompt_logprobs=convert.prompt_logprobs_proto(
                    output.prompt_logprobs, sub.prompt_top
                ),
            )
            check_size(response, self.limits.max_response_bytes)  # the call's status if not
            return response
        raise AssertionError("unreachable: _request re-raises every failure as an abort")

    async def GenerateStream(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> Events:
        async with self._request(context, request, "generate_stream") as sub:
            async for event in self._stream_events(sub):
                check_size(event, self.limits.max_response_bytes)
                yield event

    async def _stream_events(self, sub: _Submitted) -> Events:
        call, stream, num_top, record = sub.call, sub.stream, sub.num_top, sub.record
        counts: dict[int, int] = {}
        parsers: dict[int, ChoiceParser] = {}
        async for item in stream:
            if isinstance(item, RequestStarted):
                yield generation_pb2.GenerateStreamResponse(
                    start=generation_pb2.StreamStart(
                        request_id=call.request_id,
                        model=sub.model,
                        prompt_tokens=item.num_prompt_tokens,
                        cached_tokens=item.num_cached_tokens,
                    )
                )
            elif isinstance(item, ChoiceDelta):
                counts[item.index] = counts.get(item.index, 0) + len(item.token_ids)
                sub.lease.charge(len(item.token_ids))
                parser = None
                if sub.parsing is not None:
                    parser = parsers.get(item.index)
                    if parser is None:
                        parser = parsers[item.index] = sub.parsing.new()
                for event in delta_events(item, num_top, counts[item.index], parser):
                    yield event
            elif isinstance(item, RequestFinished):
                self.telemetry.record_completion(record, [c.text for c in item.output.outputs])
                if sub.prompt_top is not None:
                    positions = convert.prompt_logprobs_proto(
                        item.output.prompt_logprobs, sub.prompt_top
                    )
                    yield generation_pb2.GenerateStreamResponse(
                        prompt_logprobs=generation_pb2.PromptLogprobs(positions=positions)
                    )
                yield generation_pb2.GenerateStreamResponse(usage=convert.usage(item.output))
            else:
                raise item.error

    async def Cancel(
        self, request: generation_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.CancelResponse:
        try:
            rid = internal_id(caller_of(context, self.tenants), request.request_id)
        except Exception as exc:
            await abort(context, to_service_error(exc))
        # True exactly once per request: the first Cancel of a request still in flight.
        return generation_pb2.CancelResponse(cancelled=self.engine.abort(rid))

    async def ReleaseKv(
        self, request: generation_pb2.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ReleaseKvResponse:
        try:
            caller = caller_of(context, self.tenants)
            holders = [retained_holder(caller, key) for key in request.keys]
        except Exception as exc:
            await abort(context, to_service_error(exc))
        for holder in holders:
            if holder is not None:
                self.engine.release_holder(holder)
        return generation_pb2.ReleaseKvResponse()

    async def Session(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.SessionResponse]:
        # grpc.aio picks streaming handling by inspecting for an async generator function.
        async for message in self.sessions.run(request_iterator, context):
            yield message
