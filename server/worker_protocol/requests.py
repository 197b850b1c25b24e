"""``vllm.grpc.engine`` GenerateRequest -> tokenwire's prompt token ids and ``SamplingParams``.

The gateway tokenizes and renders chat templates itself; it sends token ids and a
``SamplingParams`` message shaped like vLLM's. Fields follow vLLM's servicer where proto3
leaves "unset" and zero alike: ``top_p`` or ``repetition_penalty`` of 0 is unset (the model's
``--generation-config`` default, else 1), ``n`` of 0 is 1, ``top_k`` of 0 disables top-k.
What tokenwire does not serve (multimodal inputs, PD KV transfer, a whole-vocabulary logprobs
request) is refused with INVALID_ARGUMENT naming the field; ``data_parallel_rank`` routes to
that engine core (the engine refuses a rank it lacks, naming the field).
Every error names the proto field (``sampling_params.temperature``, ``tokenized.input_ids``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.sampling_params import SamplingParams, StructuredOutputsParams
from tokenwire.server.grpc.convert import Limits, truncate_ids
from tokenwire.server.grpc.errors import renamed

# Runtime parameter -> the proto field a client of this protocol sent.
_CONSTRAINT_FIELDS = {
    "structured_outputs": "sampling_params.constraint",
    "structured_outputs.json": "sampling_params.json_schema",
    "structured_outputs.json_object": "sampling_params.json_object",
    "structured_outputs.regex": "sampling_params.regex",
    "structured_outputs.choice": "sampling_params.choice",
    "structured_outputs.grammar": "sampling_params.grammar",
    "structured_outputs.structural_tag": "sampling_params.structural_tag",
}
_INPUT_PARAMS = ("prompt", "input", "text")
# GenerateRequest's own fields (mm_inputs, tokenized, ...): named as they are.
_REQUEST_FIELDS = frozenset(vllm_engine_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)


def proto_param(param: str, input_kind: str = "tokenized") -> str:
    """The proto field behind a runtime parameter name."""
    if param in _CONSTRAINT_FIELDS:
        return _CONSTRAINT_FIELDS[param]
    if param in _INPUT_PARAMS:
        return "tokenized.input_ids" if input_kind == "tokenized" else "text"
    top = param.split(".", 1)[0]
    if top in _REQUEST_FIELDS or param in ("authorization", "x-priority"):
        return param
    return f"sampling_params.{param}"


def in_proto_terms(exc: ParameterError, input_kind: str = "tokenized") -> ParameterError:
    """The same error (same type: a context-length error stays one) naming the proto field."""
    name = proto_param(exc.param, input_kind)
    return exc if name == exc.param else renamed(exc, name)


def check_unsupported(request: vllm_engine_pb2.GenerateRequest) -> None:
    """Refuse what this worker does not serve, naming the field."""
    if (
        request.HasField("mm_inputs")
        or len(request.extra_mm_inputs)
        or request.HasField("media_refs")
    ):
        field = "mm_inputs" if request.HasField("mm_inputs") else "media_refs"
        if len(request.extra_mm_inputs):
            field = "extra_mm_inputs"
        raise ParameterError(field, "multimodal inputs are not supported by this worker")
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        field = "kv_transfer_params_json"
        if request.HasField("kv_transfer_params"):
            field = "kv_transfer_params"
        raise ParameterError(field, "KV transfer (PD disaggregation) is not supported")


def truncated(
    token_ids: list[int], params: vllm_engine_pb2.SamplingParams, max_len: int
) -> list[int]:
    """``truncate_prompt_tokens``: keep the last k prompt tokens (-1: the model's context)."""
    if not params.HasField("truncate_prompt_tokens"):
        return token_ids
    return truncate_ids(
        token_ids,
        params.truncate_prompt_tokens,
        max_len,
        "sampling_params.truncate_prompt_tokens",
    )


def constraint(params: vllm_engine_pb2.SamplingParams) -> StructuredOutputsParams | None:
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    try:
        if kind == "json_schema":
            return StructuredOutputsParams(json=params.json_schema)
        if kind == "regex":
            return StructuredOutputsParams(regex=params.regex)
        if kind == "grammar":
            return StructuredOutputsParams(grammar=params.grammar)
        if kind == "structural_tag":
            return StructuredOutputsParams(structural_tag=params.structural_tag)
        if kind == "json_object":
            if not params.json_object:
                return None  # json_object: false asks for nothing
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(choice=tuple(params.choice.choices))
    except ParameterError as exc:
        raise in_proto_terms(exc) from None


def _logprobs(params: vllm_engine_pb2.SamplingParams, name: str) -> int | None:
    if not params.HasField(name):
        return None
    value: int = getattr(params, name)
    if value == -1:
        raise ParameterError(
            f"sampling_params.{name}",
            "-1 (the whole vocabulary) is not supported; ask for at most 20",
        )
    return value


def sampling_params(
    params: vllm_engine_pb2.SamplingParams,
    limits: Limits,
    defaults: Mapping[str, float | int] | None = None,
) -> SamplingParams:
    """Build and validate tokenwire's params; a ``ParameterError`` names the proto field."""
    structured = constraint(params)
    model: dict[str, Any] = dict(defaults or {})
    if structured is not None:  # as tokenwire.v1: no default penalty on a constrained answer
        model.pop("repetition_penalty", None)
    n = params.n or 1
    if n > limits.max_n:
        raise ParameterError("sampling_params.n", f"must be <= {limits.max_n} (server limit)")
    stops = list(params.stop)
    if len(stops) > limits.max_stop_sequences:
        raise ParameterError(
            "sampling_params.stop", f"at most {limits.max_stop_sequences} stop sequences"
        )
    if any(len(s) > limits.max_stop_sequence_chars for s in stops):
        raise ParameterError(
            "sampling_params.stop",
            f"a stop sequence is longer than {limits.max_stop_sequence_chars} characters",
        )
    try:
        return SamplingParams(
            n=n,
            temperature=(
                params.temperature
                if params.HasField("temperature")
                else model.get("temperature", 1.0)
            ),
            top_p=params.top_p or model.get("top_p", 1.0),
            top_k=params.top_k or model.get("top_k", 0),
            min_p=params.min_p or model.get("min_p", 0.0),
            seed=params.seed if params.HasField("seed") else None,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty or model.get("repetition_penalty", 1.0),
            logit_bias=dict(params.logit_bias) or None,
            max_tokens=(
                params.max_tokens if params.HasField("max_tokens") else model.get("max_tokens")
            ),
            min_tokens=params.min_tokens,
            stop=tuple(stops),
            stop_token_ids=tuple(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            include_stop_str_in_output=params.include_stop_str_in_output,
            logprobs=_logprobs(params, "logprobs"),
            prompt_logprobs=_logprobs(params, "prompt_logprobs"),
            skip_special_tokens=params.skip_special_tokens,
            structured_outputs=structured,
        )
    except ParameterError as exc:
        raise in_proto_terms(exc) from None
