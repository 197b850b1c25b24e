"""ModelService servicer: models, limits, server facts, tokenization."""

from __future__ import annotations

import importlib.metadata

import grpc

from tokenwire.runtime.engine.protocol import EngineClient
from tokenwire.runtime.sampling_params import MAX_LOGPROBS
from tokenwire.runtime.tokenizer import Tokenizer
from tokenwire.runtime.tokenizer_pool import TokenizerPool
from tokenwire.server.grpc.convert import Limits
from tokenwire.server.grpc.errors import abort, invalid_parameter, model_not_found, to_service_error
from tokenwire.v1 import models_pb2, models_pb2_grpc


class ModelService(models_pb2_grpc.ModelServiceServicer):
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        limits: Limits,
        tokenizers: TokenizerPool | None,
        max_sessions: int,
        auth_required: bool,
    ) -> None:
        self.engine = engine
        self.tokenizers = tokenizers
        self.model_name = model_name
        self.limits = limits
        self.max_sessions = max_sessions
        self.auth_required = auth_required

    def _info(self) -> models_pb2.ModelInfo:
        info = self.engine.info
        tokenizer = self.engine.tokenizer
        return models_pb2.ModelInfo(
            name=self.model_name,
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
            kv_cache_dtype=info.kv_cache_dtype,
        )

    def _check_model(self, name: str) -> None:
        if name and name != self.model_name:
            raise model_not_found(name)

    def _pool(self) -> TokenizerPool:
        if self.tokenizers is None:
            raise invalid_parameter("model", "this model has no tokenizer")
        return self.tokenizers

    async def ListModels(
        self, request: models_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.ListModelsResponse:
        return models_pb2.ListModelsResponse(models=[self._info()])

    async def GetModelInfo(
        self, request: models_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.ModelInfo:
        try:
            self._check_model(request.model)
            return self._info()
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
        )

    async def Tokenize(
        self, request: models_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.TokenizeResponse:
        try:
            self._check_model(request.model)
            pool = self._pool()
            special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await pool.encode("text", request.text, add_special_tokens=special)
            tokens = await pool.run(pool.tokenizer.convert_ids_to_tokens, ids)
            return models_pb2.TokenizeResponse(token_ids=ids, tokens=tokens)
        except Exception as exc:
            await abort(context, to_service_error(exc))

    async def Detokenize(
        self, request: models_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.DetokenizeResponse:
        try:
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
