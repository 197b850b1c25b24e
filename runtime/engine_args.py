"""One definition of every engine flag (vLLM's ``EngineArgs``).

``EngineArgs`` is a frozen dataclass with one field per engine setting. Each field is declared
once, here: its command-line flag, type, choices and help text; its default is read from the
field of the config dataclass that holds it (``runtime/config.py``), so there is no second copy
of a default. ``tokenwire serve``, ``generate``, ``bench throughput``, ``bench overhead`` and
``LLM(**kwargs)`` all go through it, so every flag works everywhere with the same name:

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    config = EngineArgs.from_cli_args(parser.parse_args()).create_engine_config()

Each field names the config dataclass and field it sets (its ``FlagSpec``), under one name:
the field ``num_gpu_blocks_override`` is the flag ``--num-gpu-blocks-override``, the keyword
``LLM(num_gpu_blocks_override=...)`` and ``CacheConfig.num_gpu_blocks_override``.
``create_engine_config`` builds the config objects from those declarations alone (the few
values converted on the way in: ``TO_CONFIG``). Validation stays in the config dataclasses;
``create_engine_config`` re-raises their ``ValueError`` with the config field replaced by the
flag to change.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

from tokenwire.runtime.config import (
    CacheConfig,
    CpuQuantKernel,
    DType,
    EngineConfig,
    KVCacheDType,
    KVTierEvictionPolicy,
    LMHeadDType,
    LoadFormat,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    QuantizationMethod,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
)
from tokenwire.runtime.flag_values import (
    LoRAModulesAction,
    max_model_len_from_value,
    parse_lora_module,
    parse_max_model_len,
    parse_speculative_config,
    speculative_from_value,
)
from tokenwire.runtime.kv_events_config import (
    KVEventsConfig,
    kv_events_from_value,
    parse_kv_events_config,
)
from tokenwire.runtime.pooling_params import (
    TASKS,
    PoolerConfig,
    Task,
    parse_pooler_config,
    pooler_from_value,
)
from tokenwire.runtime.structured.config import StructuredOutputsConfig


@dataclass(frozen=True)
class FlagSpec:
    """How one ``EngineArgs`` field appears on the command line and in the config. The
    field, its config field and its flag (the name with dashes) have one name."""

    config: type  # the config dataclass holding this setting (and its default)
    config_field: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    action: str | builtins.type[argparse.Action] | None = None
    metavar: str | None = None


def _config_default(config: type, name: str) -> Any:
    for f in dataclasses.fields(config):
        if f.name == name:
            if f.default is dataclasses.MISSING:
                raise TypeError(f"{config.__name__}.{name} has no plain default")
            return f.default
    raise TypeError(f"{config.__name__} has no field {name!r}")


def _arg(
    config: type,
    config_field: str,
    help: str,
    *,
    type: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    action: str | type[argparse.Action] | None = None,
    metavar: str | None = None,
) -> Any:
    spec = FlagSpec(config, config_field, help, type, choices, action, metavar)
    return dataclasses.field(default=_config_default(config, config_field), metadata={"flag": spec})


@dataclass(frozen=True)
class EngineArgs:
    """Every engine setting, with the defaults of the config dataclasses."""

    model: str | None = _arg(
        ModelConfig,
        "model",
        "HF directory, .gguf file, or config dir / bundled config name with "
        "--load-format dummy (default: the embedded SmolLM2-135M-Instruct)",
    )
    tokenizer: str | None = _arg(
        ModelConfig,
        "tokenizer",
        "tokenizer directory or Hugging Face hub id ORG/NAME (default: the model's own)",
        type=str,
    )
    revision: str | None = _arg(
        ModelConfig,
        "revision",
        "hub model id: the branch, tag or commit to load (default: main)",
        type=str,
    )
    tokenizer_revision: str | None = _arg(
        ModelConfig,
        "tokenizer_revision",
        "hub tokenizer id: the branch, tag or commit to load (default: main)",
        type=str,
    )
    download_dir: str | None = _arg(
        ModelConfig,
        "download_dir",
        "Hugging Face cache directory for hub ids (default: $HF_HUB_CACHE, else "
        "$HF_HOME/hub, else ~/.cache/huggingface/hub); HF_HUB_OFFLINE=1: cache only",
        type=str,
    )
    served_model_name: str | None = _arg(
        ModelConfig,
        "served_model_name",
        "name clients use in `model` (default: the model directory or file name)",
        type=str,
    )
    chat_template: str | None = _arg(
        ModelConfig,
        "chat_template",
        "Jinja chat template file, or the template itself inline, replacing the tokenizer's "
        "for chat input (gRPC chat, OpenAI chat/completions, `tokenwire chat`, LLM.chat)",
        type=str,
    )
    generation_config: str = _arg(
        ModelConfig,
        "generation_config",
        "default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) of requests that leave them unset: auto = the model's "
        "generation_config.json (the default model: temperature 0 only), vllm = none "
        "(temperature 1.0, top_p 1.0, ...), or a folder holding a generation_config.json; "
        "a request with a structured output or a required / named tool choice gets no "
        "default repetition_penalty",
        type=str,
    )
    allow_content_special_tokens: bool = _arg(
        ModelConfig,
        "allow_content_special_tokens",
        "parse special-token text (such as <|im_start|>) inside user and tool message content "
        "as the special tokens themselves, as before; this lets a client forge chat turns "
        "(default: such text is plain text; system and assistant messages are unaffected)",
        action="store_true",
    )
    task: Task = _arg(  # noqa: RUF009 (returns an immutable str)
        ModelConfig,
        "task",
        "what the model serves: generate (text), embed (embeddings: EmbeddingService.Embed, "
        "POST /v1/embeddings, LLM.embed), or auto = embed for BERT-family encoders and for "
        "directories with a sentence-transformers pooling module, else generate",
        choices=TASKS,
    )
    pooler_config: PoolerConfig | None = _arg(  # noqa: RUF009 (a frozen dataclass or None)
        ModelConfig,
        "pooler_config",
        'embedding models: JSON {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true} '
        "overriding the model's sentence-transformers pooling (default there: LAST + "
        "normalize for decoders, CLS + normalize for encoders)",
        type=parse_pooler_config,
        metavar="JSON",
    )
    dtype: DType = _arg(  # noqa: RUF009 (returns an immutable str)
        ModelConfig,
        "dtype",
        "weights and activations: auto = float32 on CPU, bfloat16 on CUDA (a .gguf on CPU: "
        "its Q4 linears kept quantized, bf16 matmuls; an explicit float32 loads it "
        "de-quantized, exact)",
        choices=get_args(DType),
    )
    lm_head_dtype: LMHeadDType = _arg(  # noqa: RUF009 (returns an immutable str)
        ModelConfig,
        "lm_head_dtype",
        "CPU LM head weights: auto = int8 (with --cpu-quant-kernel vnni in effect) or bfloat16 "
        "for a .gguf kept quantized (--dtype auto), else float32; bfloat16 / int8 stream a "
        "bf16 copy (half the bytes) / int8 codes per 32-block (a quarter, AVX-512 VNNI) and "
        "recompute each row's top 16 logits in float32; float32 = exact",
        choices=get_args(LMHeadDType),
    )
    cpu_quant_kernel: CpuQuantKernel = _arg(  # noqa: RUF009 (returns an immutable str)
        ModelConfig,
        "cpu_quant_kernel",
        "CPU kernel for a .gguf kept quantized: auto = vnni where the CPU has AVX-512 VNNI "
        "and a C compiler builds it, else torch; vnni = int8 activations x int4 codes in "
        "integer dot products (as llama.cpp; not exact), an error where unavailable; torch = "
        "torch's int4 kernel (bf16 activations)",
        choices=get_args(CpuQuantKernel),
    )
    cpu_fused_layers: bool = _arg(
        ModelConfig,
        "cpu_fused_layers",
        "on CPU, run a model whose linears all take the VNNI kernel as one decoder-stack "
        "operator (norms, rotary, paged attention and SwiGLU in C) where its layers allow it",
        action=argparse.BooleanOptionalAction,
    )
    device: str = _arg(EngineConfig, "device", "auto, cpu, cuda or cuda:N", type=str)
    max_model_len: int | str | None = _arg(
        ModelConfig,
        "max_model_len",
        "context length: an integer, 8k (= 8000), 8K (= 8192), 1m, 1M (vLLM's forms), or "
        "auto (default: the model's own)",
        type=parse_max_model_len,
    )
    max_num_seqs: int = _arg(
        SchedulerConfig, "max_num_seqs", "sequences scheduled in one step", type=int
    )
    max_num_batched_tokens: int = _arg(
        SchedulerConfig, "max_num_batched_tokens", "tokens scheduled in one step", type=int
    )
    encoder_cache_size: int | None = _arg(
        SchedulerConfig,
        "encoder_cache_size",
        "image inputs: feature vectors (placeholder tokens) the encoder-output cache keeps, "
        "keyed by image content hash and evicted least recently used (default: 8192 or "
        "--max-num-encoder-input-tokens if larger); a larger image is refused",
        type=int,
        metavar="TOKENS",
    )
    max_num_encoder_input_tokens: int | None = _arg(
        SchedulerConfig,
        "max_num_encoder_input_tokens",
        "image inputs: feature vectors the vision encoder computes in one step (default: "
        "--max-num-batched-tokens); cached images cost nothing, and a step's first image may "
        "exceed it",
        type=int,
        metavar="TOKENS",
    )
    block_size: int = _arg(
        CacheConfig, "block_size", "KV cache block size in tokens (a power of two)", type=int
    )
    gpu_memory_utilization: float = _arg(
        CacheConfig,
        "gpu_memory_utilization",
        "CUDA: fraction of device memory for weights, activations and the KV cache",
        type=float,
    )
    kv_cache_memory: int | None = _arg(
        CacheConfig,
        "kv_cache_memory",
        "CPU: KV cache size in bytes (tokenwire generate without it: what its one prompt "
        "can use, one --max-model-len sequence, at most this default)",
        type=int,
        metavar="BYTES",
    )
    kv_cache_dtype: KVCacheDType = _arg(  # noqa: RUF009 (returns an immutable str)
        CacheConfig,
        "kv_cache_dtype",
        "KV cache storage: auto = the model dtype; fp8 (= fp8_e4m3) stores float8 e4m3 with a "
        "per-layer scale (1.0), half the bytes of bfloat16 and a quarter of float32",
        choices=get_args(KVCacheDType),
    )
    num_gpu_blocks_override: int | None = _arg(
        CacheConfig,
        "num_gpu_blocks_override",
        "fix the number of KV blocks on any device (wins over both budgets)",
        type=int,
    )
    kv_offloading_size: float | None = _arg(
        CacheConfig,
        "kv_offloading_size",
        "GiB of host memory for a KV tier under the device cache: evicted prefix blocks are "
        "kept there and copied back on a prefix hit (0 or unset: off; docs/kv-tiers.md)",
        type=float,
        metavar="GiB",
    )
    kv_offloading_disk_path: str | None = _arg(
        CacheConfig,
        "kv_offloading_disk_path",
        "directory of a disk KV tier under the host tier: blocks the host tier evicts are "
        "written there (one preallocated file, checksummed records) and loaded back on a prefix "
        "hit; a restarted server reuses the records that match its model (docs/kv-tiers.md)",
        metavar="DIR",
    )
    kv_offloading_disk_size: float | None = _arg(
        CacheConfig,
        "kv_offloading_disk_size",
        "GiB of disk for --kv-offloading-disk-path (preallocated at startup)",
        type=float,
        metavar="GiB",
    )
    kv_offloading_eviction_policy: KVTierEvictionPolicy = _arg(  # noqa: RUF009 (a str)
        CacheConfig,
        "kv_offloading_eviction_policy",
        "which block a full KV tier (host and disk) gives up: lru = the least recently used; "
        "arc = adaptive replacement, which keeps blocks hit again through scans of blocks used "
        "once (docs/kv-tiers.md)",
        choices=get_args(KVTierEvictionPolicy),
    )
    enable_prefix_caching: bool = _arg(
        CacheConfig,
        "enable_prefix_caching",
        "reuse the KV blocks of a shared prompt prefix",
        action=argparse.BooleanOptionalAction,
    )
    enable_chunked_prefill: bool = _arg(
        SchedulerConfig,
        "enable_chunked_prefill",
        "split long prompts over several steps' token budgets",
        action=argparse.BooleanOptionalAction,
    )
    async_scheduling: bool = _arg(
        SchedulerConfig,
        "async_scheduling",
        "plan step k+1 while step k runs (one step in flight); features it does not cover "
        "yet run synchronous steps (docs/serving.md#async-scheduling)",
        action=argparse.BooleanOptionalAction,
    )
    scheduling_policy: SchedulingPolicy = _arg(  # noqa: RUF009 (returns an immutable str)
        SchedulerConfig,
        "scheduling_policy",
        "fcfs, or priority (lower value first)",
        choices=get_args(SchedulingPolicy),
    )
    tensor_parallel_size: int = _arg(
        ParallelConfig,
        "tensor_parallel_size",
        "ranks (processes, one device each) to shard the model over",
        type=int,
    )
    data_parallel_size: int = _arg(
        ParallelConfig,
        "data_parallel_size",
        "engine cores behind one front, each with the whole model (its own GPU on CUDA, its "
        "share of the cores on CPU); requests are balanced by load with prefix and Session "
        "affinity",
        type=int,
    )
    distributed_init_method: str | None = _arg(
        ParallelConfig,
        "distributed_init_method",
        "tensor parallelism rendezvous: tcp://HOST:PORT or env:// (torchrun's MASTER_ADDR / "
        "MASTER_PORT); default: --master-addr/--master-port with several nodes, else a free "
        "loopback port",
        type=str,
    )
    nnodes: int = _arg(
        ParallelConfig, "nnodes", "nodes the tensor-parallel ranks are spread over", type=int
    )
    node_rank: int = _arg(
        ParallelConfig,
        "node_rank",
        "this node's index (0 runs the server; others run `tokenwire worker`)",
        type=int,
    )
    master_addr: str = _arg(
        ParallelConfig, "master_addr", "node 0's address for the rendezvous", type=str
    )
    master_port: int = _arg(ParallelConfig, "master_port", "rendezvous TCP port", type=int)
    distributed_timeout: float = _arg(
        ParallelConfig,
        "distributed_timeout",
        "seconds a collective waits on a silent rank before the engine is declared dead",
        type=float,
    )
    distributed_startup_timeout: float = _arg(
        ParallelConfig,
        "distributed_startup_timeout",
        "seconds the ranks may take to meet and load the model",
        type=float,
    )
    enforce_eager: bool = _arg(
        EngineConfig,
        "enforce_eager",
        "CUDA: run every step eagerly (no decode CUDA graphs)",
        action="store_true",
    )
    cpu_compile: bool = _arg(
        EngineConfig,
        "cpu_compile",
        "CPU: compile the model's forward with torch.compile (inductor) at startup; attention "
        "stays eager (docs/benchmarks.md#compiled-cpu-forward---cpu-compile)",
        action=argparse.BooleanOptionalAction,
    )
    load_format: LoadFormat = _arg(  # noqa: RUF009 (returns an immutable str)
        ModelConfig,
        "load_format",
        "weights: auto, safetensors, gguf, or dummy (random weights from a config)",
        choices=get_args(LoadFormat),
    )
    seed: int = _arg(
        ModelConfig, "seed", "seed of dummy weights and of unseeded sampling", type=int
    )
    quantization: QuantizationMethod | None = _arg(  # noqa: RUF009 (an immutable str)
        ModelConfig,
        "quantization",
        "weight scheme: fp8 (fp8 e4m3 checkpoints: compressed-tensors or HF fp8; or "
        "quantize an unquantized checkpoint at load: per-channel fp8 weights), "
        "gptq or awq (checkpoints in that format), int8 (quantize an "
        "unquantized checkpoint at load: per-channel int8 weights), gguf (a .gguf's "
        "Q4_0/Q4_1/Q8_0 linears kept quantized, matmuls in --dtype); default: detected from "
        "config.json quantization_config",
        choices=get_args(QuantizationMethod),
    )

    enable_lora: bool = _arg(
        LoRAConfig,
        "enable_lora",
        "serve LoRA adapters (PEFT format) on the base model, chosen per request by `model`",
        action="store_true",
    )
    lora_modules: tuple[tuple[str, str], ...] = _arg(
        LoRAConfig,
        "lora_modules",
        "adapters loaded at startup, as NAME=PATH (PATH: a PEFT adapter directory)",
        type=parse_lora_module,
        action=LoRAModulesAction,
        metavar="NAME=PATH",
    )
    max_loras: int = _arg(
        LoRAConfig, "max_loras", "LoRA adapters resident on the device at once", type=int
    )
    max_lora_rank: int = _arg(LoRAConfig, "max_lora_rank", "largest adapter rank", type=int)
    max_cpu_loras: int | None = _arg(
        LoRAConfig,
        "max_cpu_loras",
        "LoRA adapters kept in CPU memory per worker (default: --max-loras)",
        type=int,
    )
    speculative_config: SpeculativeConfig | None = _arg(  # noqa: RUF009 (a frozen config)
        EngineConfig,
        "speculative_config",
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5, "disable_by_batch_size": N} or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}',
        type=parse_speculative_config,
        metavar="JSON",
    )
    kv_events_config: KVEventsConfig | None = _arg(  # noqa: RUF009 (a frozen config)
        EngineConfig,
        "kv_events_config",
        'KV-cache events, vLLM\'s JSON: {"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "buffer_steps": N, '
        '"hwm": N, "topic": ""} (docs/fleet.md)',
        type=parse_kv_events_config,
        metavar="JSON",
    )
    structured_outputs_cache_bytes: int = _arg(
        StructuredOutputsConfig,
        "structured_outputs_cache_bytes",
        "compiled grammars the engine core keeps (least recently used dropped first), in "
        "bytes; also the most one grammar may compile to (a larger one: INVALID_ARGUMENT)",
        type=int,
        metavar="BYTES",
    )

    # ------------------------------------------------------------------ command line
    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser,
        *,
        model_positional: bool = True,
        model_help: str | None = None,
    ) -> argparse.ArgumentParser:
        """Add every engine flag to ``parser``. The model is the optional positional ``MODEL``
        (``serve``, ``bench``) or ``--model`` where a positional means something else
        (``generate``'s prompt); ``model_help`` replaces its help text."""
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(EngineArgs):
            spec = flag_spec(f.name)
            kwargs: dict[str, Any] = {"default": f.default, "help": _help(spec, f.default)}
            if spec.action is not None:
                kwargs["action"] = spec.action
            if spec.type is not None:
                kwargs["type"] = spec.type
            if spec.choices is not None:
                kwargs["choices"] = spec.choices
            if spec.metavar is not None:
                kwargs["metavar"] = spec.metavar
            if f.name == "model" and model_help is not None:
                kwargs["help"] = model_help
            if f.name == "model" and model_positional:
                group.add_argument("model", nargs="?", metavar="MODEL", **kwargs)
            else:
                group.add_argument(flag_of(f.name), dest=f.name, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    # ------------------------------------------------------------------ config
    def create_engine_config(self) -> EngineConfig:
        """The frozen ``EngineConfig``, built from each field's declared config field (its
        ``FlagSpec``): the sections (``ModelConfig``, ``CacheConfig``, ...) get their fields'
        values, ``EngineConfig`` the rest; a section no field names keeps its defaults. A bad
        value raises a ``ValueError`` naming its flag."""
        values: dict[type, dict[str, Any]] = {}
        try:
            for f in dataclasses.fields(self):
                spec = flag_spec(f.name)
                value = getattr(self, f.name)
                convert = TO_CONFIG.get(f.name)
                values.setdefault(spec.config, {})[spec.config_field] = (
                    value if convert is None else convert(value)
                )
            sections = {
                name: config(**values.get(config, {})) for name, config in config_sections().items()
            }
            return EngineConfig(**sections, **values.get(EngineConfig, {}))
        except ValueError as exc:
            raise ValueError(name_flags(str(exc))) from None


# The one place where an ``EngineArgs`` value is not its config field's value as it is: what
# ``LLM(**kwargs)`` may pass in another form than the flag's parsed one.
TO_CONFIG: dict[str, Callable[[Any], Any]] = {
    "max_model_len": max_model_len_from_value,  # LLM(max_model_len="8k")
    "speculative_config": speculative_from_value,  # vLLM's dict, or the flag's JSON text
    "kv_events_config": kv_events_from_value,
    "lora_modules": tuple,  # LLM(lora_modules=[("name", "/path")])
    "pooler_config": pooler_from_value,  # LLM(pooler_config={"pooling_type": "MEAN"})
}


def config_sections() -> dict[str, type]:
    """``EngineConfig``'s fields that are config dataclasses (``model`` -> ``ModelConfig``)."""
    hints = typing.get_type_hints(EngineConfig)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(EngineConfig)
        if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])
    }


def flag_spec(name: str) -> FlagSpec:
    """The declaration of ``EngineArgs`` field ``name``."""
    for f in dataclasses.fields(EngineArgs):
        if f.name == name:
            spec: FlagSpec = f.metadata["flag"]
            return spec
    raise KeyError(name)


def flag_of(name: str) -> str:
    """The command-line flag of ``EngineArgs`` field ``name`` (``--max-model-len``)."""
    flag_spec(name)  # KeyError for a name that is no field
    return "--" + name.replace("_", "-")


def engine_flags() -> tuple[str, ...]:
    """Every engine option string (``--[no-]`` forms included; the model's is ``--model``)."""
    flags: list[str] = []
    for f in dataclasses.fields(EngineArgs):
        flag = flag_of(f.name)
        flags.append(flag)
        if flag_spec(f.name).action is argparse.BooleanOptionalAction:
            flags.append("--no-" + flag.removeprefix("--"))
    return tuple(flags)


def _help(spec: FlagSpec, default: Any) -> str:
    if spec.action is not None or default is None:
        return spec.help
    return f"{spec.help} (default: {default})"


def _config_flags() -> dict[str, str]:
    """Config field name -> the flag that sets it."""
    return {flag_spec(f.name).config_field: flag_of(f.name) for f in dataclasses.fields(EngineArgs)}


def name_flags(message: str) -> str:
    """A config error message with config field names replaced by their flags.

    The leading word is the field at fault (``block_size must be ...``); other snake_case
    field names later in the message (``... >= max_model_len``) are replaced too. Single
    words (``device``, ``seed``) are only replaced in the lead, where they cannot be prose.
    """
    flags = _config_flags()
    head, sep, rest = message.partition(" ")
    if head in flags:
        head = flags[head]
    for name in flags:
        if "_" in name:
            rest = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", flags[name], rest)
    return head + sep + rest
