"""``GetModelInfo`` and ``GetServerInfo`` from the engine's ``EngineInfo`` (the fields the
gateway turns into worker labels at registration).

``model_path`` is the served model's name and ``tokenizer_path`` is left empty on purpose: a
gateway that cannot load a tokenizer from a worker's label path fetches it with
``GetTokenizer`` (the bundle this worker builds from its own tokenizer), which works across
hosts; a local path would only work on this one.
"""

from __future__ import annotations

import json
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2

from tokenwire.runtime.engine.protocol import EngineClient

SERVER_TYPE = "vllm-grpc"
# The defaults a gateway applies for fields a request leaves unset (vLLM's keys).
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def default_sampling_json(defaults: dict[str, float | int]) -> str:
    kept = {key: defaults[key] for key in _SAMPLING_KEYS if key in defaults}
    return json.dumps(kept, separators=(",", ":")) if kept else ""


def _token_id(tokenizer: Any, name: str) -> int:
    value = getattr(tokenizer, name, None) if tokenizer is not None else None
    return value if isinstance(value, int) else 0


def model_info(engine: EngineClient, model_name: str) -> vllm_engine_pb2.GetModelInfoResponse:
    info = engine.info
    tokenizer = engine.tokenizer
    return vllm_engine_pb2.GetModelInfoResponse(
        model_path=model_name,
        is_generation=True,
        max_context_length=info.max_model_len,
        vocab_size=info.vocab_size,
        supports_vision=False,
        served_model_name=model_name,
        tokenizer_path="",
        model_type="",
        architectures=[info.architecture] if info.architecture else [],
        eos_token_ids=list(info.eos_token_ids),
        pad_token_id=_token_id(tokenizer, "pad_token_id"),
        bos_token_id=_token_id(tokenizer, "bos_token_id"),
        max_req_input_len=info.max_model_len,
        default_sampling_params_json=default_sampling_json(info.default_sampling),
    )


def server_info(
    engine: EngineClient, uptime_seconds: float, serving: bool
) -> vllm_engine_pb2.GetServerInfoResponse:
    info = engine.info
    return vllm_engine_pb2.GetServerInfoResponse(
        active_requests=engine.num_in_flight,
        is_paused=not serving,
        uptime_seconds=uptime_seconds,
        server_type=SERVER_TYPE,
        data_parallel_size=info.data_parallel_size,
        kv_cache_dtype=info.kv_cache_dtype,
        block_size=info.block_size,
        model_dtype=info.dtype,
        max_num_seqs=info.max_num_seqs,
    )
