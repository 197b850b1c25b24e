"""ModelService servicer: models (the base and its LoRA adapters), limits, server facts,
tokenization, and loading / unloading adapters at runtime."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping

import grpc

from tokenwire.runtime.engine.protocol import EngineClient
from tokenwire.runtime.front.tokenizer import Tokenizer
from tokenwire.runtime.sampling_params import MAX_LOGPROBS
from tokenwire.server.grpc.adapters import (
    AdapterAdmin,
    AdapterFlags,
    adapter_not_found,
    resolve_model,
)
from tokenwire.server.grpc.call_context import identify
from tokenwire.server.grpc.convert import Limits, render_chat
from tokenwire.server.grpc.errors import abort, invalid_parameter, to_service_error
from tokenwire.server.grpc.request_options import template_kwargs
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool
from tokenwire.server.grpc.tools import chat_messages, chat_tooling
from tokenwire.server.tenants.limits import ModelNotAllowed
from tokenwire.server.tenants.registry import TenantRegistry
from tokenwire.v1 import common_pb2, models_pb2, models_pb2_grpc

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _default_max_tokens(defaults: Mapping[str, float | int]) -> int | None:
    value = defaults.get("max_tokens")
    return None if value is None else int(value)


def _default_sampling(defaults: Mapping[str, float | int]) -> common_pb2.SamplingOptions:
    """``EngineInfo.default_sampling`` as the SamplingOptions fields it sets."""
    options = common_pb2.SamplingOptions()
    for name in _SAMPLING_FIELDS:
        if name in defaults:
            value = defaults[name]
            setattr(options, name, int(value) if name == "top_k" else float(value))
    return options


class ModelService(models_pb2_grpc.ModelServiceServicer):
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        limits: Limits,
        tokenizers: TokenizerPool | None,
        max_sessions: int,
        auth_required: bool,
        adapter_flags: AdapterFlags | None = None,
        tenants: TenantRegistry | None = None,
        replica_id: str = "",
    ) -> None:
        """``tenants``: ListModels shows a caller only the models its tenant may use; every
        other RPC that takes a name answers one outside the tenant's list exactly like an
        unknown name (NOT_FOUND), so no tenant learns other tenants' adapters (None: every
        caller sees and manages all)."""
        self.engine = engine
        self.tenants = tenants
        self.tokenizers = tokenizers
        self.model_name = model_name
        self.limits = limits
        self.max_sessions = max_sessions
        self.auth_required = auth_required
        self.adapters = AdapterAdmin(engine, model_name, adapter_flags or AdapterFlags())
        self.replica_id = replica_id

    def _info(self, name: str = "") -> models_pb2.ModelInfo:
        """The base model (``name`` empty or its own) or one of its adapters."""
        info = self.engine.info
        tokenizer = self.engine.tokenizer
        adapter = bool(name) and name != self.model_name
        return models_pb2.ModelInfo(
            name=name if adapter else self.model_name,
            parent=self.model_name if adapter else "",
            architecture=info.architecture,
            max_context_tokens=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
            has_chat_template=bool(tokenizer is not None and tokenizer.chat_template),
            max_n=self.limits.max_n,
            max_stop_sequences=self.limits.max_stop_sequences,
            max_logprobs=MAX_LOGPROBS,
            dtype=info.dtype,
            tensor_parallel_size=info.tensor_parallel_size,
            quantization=info.quantization or "",
            weight_bytes=info.weight_bytes,
            kv_bytes_per_token=info.kv_bytes_per_token,
            kv_cache_dtype=info.kv_cache_dtype,
            default_sampling=_default_sampling(info.default_sampling),
            default_max_tokens=_default_max_tokens(info.default_sampling),
            task=info.task,
            embedding_dimensions=info.embedding_dimensions,
        )

    def _check_model(self, name: str) -> None:
        """The base model or a loaded adapter (same tokenizer and limits); NOT_FOUND else."""
        resolve_model(self.engine, self.model_name, name)

    def _check_tenant(self, context: grpc.aio.ServicerContext, name: str) -> None:
        """ModelNotAllowed (answered as NOT_FOUND) unless the caller's tenant may use
        ``name`` (no tenants: all). Checked before the name is resolved, always."""
        if self.tenants is None:
            return
        tenant = identify(context, self.tenants).tenant
        if not tenant.allows_model(name or self.model_name):
            raise ModelNotAllowed(tenant.name, name or self.model_name)

    def _check_adapter_tenant(self, context: grpc.aio.ServicerContext, name: str) -> None:
        """LoadAdapter / UnloadAdapter: a name outside the tenant's list is answered like
        unloading one that is not loaded (an empty name is INVALID_ARGUMENT later)."""
        try:
            if name:
                self._check_tenant(context, name)
        except ModelNotAllowed:
            raise adapter_not_found(name) from None

    def _pool(self) -> TokenizerPool:
        if self.tokenizers is None:
            raise invalid_parameter("model", "this model has no tokenizer")
        return self.tokenizers

    async def ListModels(
        self, request: models_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.ListModelsResponse:
        adapters = self.engine.list_loras() if self.engine.info.max_loras > 0 else []
        models = [self._info(), *(self._info(a.lora_name) for a in adapters)]
        try:
            tenant = None if self.tenants is None else identify(context, self.tenants).tenant
        except Exception as exc:
            await abort(context, to_service_error(exc))
        if tenant is not None:
            models = [m for m in models if tenant.allows_model(m.name)]
        return models_pb2.ListModelsResponse(models=models)

    async def GetModelInfo(
        self, request: models_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.ModelInfo:
        try:
            self._check_tenant(context, request.model)
            self._check_model(request.model)
            return self._info(request.model)
        except Exception as exc:
            await abort(context, to_service_error(exc))

    async def GetServerInfo(
        self, request: models_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.ServerInfo:
        info = self.engine.info
        return models_pb2.ServerInfo(
            version=importlib.metadata.version("tokenwire"),
            device=info.device,
            kv_blocks_total=info.num_kv_blocks,
            block_size=info.block_size,
            max_num_seqs=info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            prefix_caching=info.enable_prefix_caching,
            max_sessions=self.max_sessions,
            auth_required=self.auth_required,
            max_loras=info.max_loras,
            max_lora_rank=info.max_lora_rank,
            runtime_lora_updating=self.adapters.allowed,
            replica_id=self.replica_id,
        )

    async def LoadAdapter(
        self, request: models_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.LoadAdapterResponse:
        try:
            self._check_adapter_tenant(context, request.lora_name)
            lora = await self.adapters.load(request.lora_name, request.lora_path)
            return models_pb2.LoadAdapterResponse(model=self._info(lora.lora_name))
        except Exception as exc:
            await abort(context, to_service_error(exc))

    async def UnloadAdapter(
        self, request: models_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.UnloadAdapterResponse:
        try:
            self._check_adapter_tenant(context, request.lora_name)
            await self.adapters.unload(request.lora_name)
            return models_pb2.UnloadAdapterResponse()
        except Exception as exc:
            await abort(context, to_service_error(exc))

    async def Tokenize(
        self, request: models_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.TokenizeResponse:
        try:
            self._check_tenant(context, request.model)
            self._check_model(request.model)
            pool = self._pool()
            if request.HasField("chat"):
                if request.text:
                    raise invalid_parameter("text", "give text or chat, not both")
                chat = request.chat
                tools = chat_tooling(chat).tools
                ids = await render_chat(pool, chat_messages(chat), tools, template_kwargs(chat))
            else:
                special = (
                    request.add_special_tokens if request.HasField("add_special_tokens") else True
                )
                ids = await pool.encode("text", request.text, add_special_tokens=special)
            tokens = await pool.run(pool.tokenizer.convert_ids_to_tokens, ids)
            return models_pb2.TokenizeResponse(token_ids=ids, tokens=tokens)
        except Exception as exc:
            await abort(context, to_service_error(exc))

    async def Detokenize(
        self, request: models_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.DetokenizeResponse:
        try:
            self._check_tenant(context, request.model)
            self._check_model(request.model)
            pool = self._pool()
            vocab = self.engine.info.vocab_size
            if any(t >= vocab for t in request.token_ids):
                raise invalid_parameter("token_ids", f"ids must lie in [0, {vocab})")
            skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
            text = await pool.run(_decode, pool.tokenizer, list(request.token_ids), skip)
            return models_pb2.DetokenizeResponse(text=text)
        except Exception as exc:
            await abort(context, to_service_error(exc))


def _decode(tokenizer: Tokenizer, token_ids: list[int], skip_special_tokens: bool) -> str:
    return str(tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))
