"""Frozen engine configuration.

Config is data: every class here is frozen and validated in ``__post_init__`` with a
``ValueError`` that names the offending flag. Values derived from the model or the device
(number of KV blocks, EOS ids, effective max_model_len) are *returned* by whoever computes
them and passed forward; they are never written back into these objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from tokenwire.runtime.config_checks import positive
from tokenwire.runtime.kv_events_config import KVEventsConfig
from tokenwire.runtime.kv_tier_flags import check_tier_flags
from tokenwire.runtime.parallel_config import ParallelConfig as ParallelConfig
from tokenwire.runtime.pooling_params import TASKS, PoolerConfig, Task
from tokenwire.runtime.speculative_config import SpeculativeConfig as SpeculativeConfig
from tokenwire.runtime.structured.config import StructuredOutputsConfig

LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]
SchedulingPolicy = Literal["fcfs", "priority"]
DType = Literal["auto", "float32", "float16", "bfloat16"]
# The CPU LM head's weight copy: auto = int8 (VNNI kernel) or bfloat16 for a GGUF kept
# quantized on CPU, else float32.
LMHeadDType = Literal["auto", "float32", "bfloat16", "int8"]
# The CPU kernel of a GGUF kept quantized: auto = vnni where the CPU and a C compiler allow it
# (kernels.vnni_matmul), else torch's int4 kernel; vnni = that kernel or a startup error.
CpuQuantKernel = Literal["auto", "vnni", "torch"]
# Weight schemes (vLLM's names): gptq / awq checkpoints, int8 = online weight-only int8 of an
# unquantized checkpoint, fp8 = compressed-tensors / HF fp8 checkpoints or online fp8 of an
# unquantized checkpoint, gguf = a .gguf file's Q4/Q8 linears kept quantized. None (the
# default) detects the checkpoint's quantization_config.
QuantizationMethod = Literal["fp8", "gptq", "awq", "int8", "gguf"]
# KV cache storage (vLLM's names): auto = the model dtype; fp8 / fp8_e4m3 = float8 e4m3 with a
# per-layer float32 scale for K and one for V.
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3"]
# Which block a full KV tier gives up (runtime/core/tier_index.py): least recently used, or ARC.
KVTierEvictionPolicy = Literal["lru", "arc"]

# Default CPU KV budget: 2 GiB holds ~46k tokens of SmolLM2-135M's float32 KV cache
# (30 layers x 2 x 3 KV heads x 64 dims x 4 bytes = 46 KiB per token).
DEFAULT_CPU_KV_BYTES = 2 << 30
# Sequences in flight (a request with n choices counts n) before the front refuses more
# (``AsyncEngine``; ``tokenwire serve --max-requests``).
DEFAULT_MAX_REQUESTS = 4096


# Encoder-output cache of image features when --encoder-cache-size is unset: 8192 vectors
# (14 LLaVA-1.5 images of 576; 64 MiB at hidden 4096 in float16).
DEFAULT_ENCODER_CACHE_SIZE = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how.

    ``model=None`` selects the embedded default (SmolLM2-135M-Instruct GGUF).
    ``max_model_len=None`` means "the model's own context length".
    ``quantization=None`` means "whatever the checkpoint's quantization_config says".
    ``model`` / ``tokenizer`` may be Hugging Face hub ids (``ORG/NAME``), resolved from the HF
    cache (``download_dir``, else ``$HF_HUB_CACHE``) at ``revision`` / ``tokenizer_revision``.
    ``chat_template``: a Jinja file or inline template overriding the tokenizer's (the front
    renders it). ``generation_config``: where requests' default sampling parameters come from:
    ``auto`` (the model's generation_config.json), ``vllm`` (none) or a folder holding one.
    ``allow_content_special_tokens``: special-token text in user and tool message content is
    parsed as special tokens (the old way: a message can forge a chat turn); default: text.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: DType = "auto"
    lm_head_dtype: LMHeadDType = "auto"
    cpu_quant_kernel: CpuQuantKernel = "auto"
    cpu_fused_layers: bool = True
    max_model_len: int | None = None
    load_format: LoadFormat = "auto"
    seed: int = 0
    served_model_name: str | None = None
    quantization: QuantizationMethod | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    chat_template: str | None = None
    generation_config: str = "auto"
    allow_content_special_tokens: bool = False
    # generate / embed (auto: from the checkpoint); embed models' pooler override.
    task: Task = "auto"
    pooler_config: PoolerConfig | None = None

    def __post_init__(self) -> None:
        positive("max_model_len", self.max_model_len)
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}")
        if not self.generation_config:
            raise ValueError("generation_config must be auto, vllm or a folder, got ''")
        quant_methods = ("fp8", "gptq", "awq", "int8", "gguf")
        if self.quantization is not None and self.quantization not in quant_methods:
            raise ValueError(
                f"quantization must be one of fp8, gptq, awq, int8, gguf; got {self.quantization!r}"
            )
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                "load_format must be one of auto, safetensors, gguf, dummy; "
                f"got {self.load_format!r}"
            )
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be one of auto, float32, float16, bfloat16; got {self.dtype!r}"
            )
        if self.lm_head_dtype not in get_args(LMHeadDType):
            raise ValueError(
                "lm_head_dtype must be one of auto, float32, bfloat16, int8; "
                f"got {self.lm_head_dtype!r}"
            )
        if self.cpu_quant_kernel not in get_args(CpuQuantKernel):
            raise ValueError(
                f"cpu_quant_kernel must be one of auto, vnni, torch; got {self.cpu_quant_kernel!r}"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape and budget.

    On CPU the cache is sized from ``kv_cache_memory`` (bytes); on CUDA from
    ``gpu_memory_utilization`` after a profiling forward. ``num_gpu_blocks_override`` wins over
    both (tests use it to force preemption). ``kv_cache_memory=None`` (the offline ``tokenwire
    generate`` without ``--kv-cache-memory``): ``DEFAULT_CPU_KV_BYTES`` at most, and no more
    than ``max_num_seqs`` sequences of ``max_model_len`` tokens can use.
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = DEFAULT_CPU_KV_BYTES
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    # At most this fraction of KV blocks stays pinned by idle sessions between turns.
    session_cache_fraction: float = 0.5
    kv_cache_dtype: KVCacheDType = "auto"
    # KV tiers (docs/kv-tiers.md): GiB of host memory for evicted prefix blocks; None/0: off.
    kv_offloading_size: float | None = None
    # The disk tier under it: a directory and its GiB; blocks the host tier evicts go there.
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float | None = None
    kv_offloading_eviction_policy: KVTierEvictionPolicy = "lru"  # both tiers

    def __post_init__(self) -> None:
        positive("block_size", self.block_size)
        check_tier_flags(
            self.kv_offloading_size, self.kv_offloading_disk_path, self.kv_offloading_disk_size
        )
        if self.block_size > 1024 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two <= 1024, got {self.block_size}")
        positive("kv_cache_memory", self.kv_cache_memory)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not 0.0 <= self.session_cache_fraction <= 1.0:
            raise ValueError(
                f"session_cache_fraction must be in [0, 1], got {self.session_cache_fraction}"
            )
        if self.kv_offloading_eviction_policy not in get_args(KVTierEvictionPolicy):
            raise ValueError(
                "kv_offloading_eviction_policy must be lru or arc; got "
                f"{self.kv_offloading_eviction_policy!r}"
            )
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(
                f"kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got {self.kv_cache_dtype!r}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 2 (one is the null block), "
                f"got {self.num_gpu_blocks_override}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget continuous batching limits (vLLM v1 semantics)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduling_policy: SchedulingPolicy = "fcfs"
    enable_chunked_prefill: bool = True
    # Plan step k+1 while step k runs (``engine/async_steps.py``); off by default for now.
    async_scheduling: bool = False
    # Image inputs (``core.encoder_cache``): feature vectors the encoder-output cache holds
    # (None: ``DEFAULT_ENCODER_CACHE_SIZE`` or the encoder budget if larger) and encoded per
    # step (None: ``max_num_batched_tokens``, as vLLM).
    encoder_cache_size: int | None = None
    max_num_encoder_input_tokens: int | None = None

    def __post_init__(self) -> None:
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("encoder_cache_size", self.encoder_cache_size)
        positive("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )

    @property
    def encoder_budget(self) -> int:
        """Image feature vectors one step may encode (the first image of a step may exceed)."""
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    @property
    def encoder_capacity(self) -> int:
        """Image feature vectors the encoder-output cache holds at most."""
        if self.encoder_cache_size is not None:
            return self.encoder_cache_size
        return max(DEFAULT_ENCODER_CACHE_SIZE, self.encoder_budget)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's flags). ``lora_modules``: (name, path) adapters loaded at
    startup; ``max_loras``: adapters resident on the device at once (one step serves at most
    this many); ``max_cpu_loras``: adapters kept in CPU memory per worker (None: max_loras)."""

    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        positive("max_loras", self.max_loras)
        positive("max_lora_rank", self.max_lora_rank)
        positive("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {names}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; built once by ``LLM``/the CLI
    (``EngineArgs.create_engine_config``) and passed down. Its config-dataclass fields are
    the sections that ``EngineArgs`` fields name; ``structured_outputs`` (the engine core's
    grammar compile pool and cache) has one flag, ``--structured-outputs-cache-bytes``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: SpeculativeConfig | None = None
    kv_events_config: KVEventsConfig | None = None
    device: str = "auto"
    # CUDA only: run every step eagerly instead of replaying decode CUDA graphs.
    enforce_eager: bool = False
    # CPU only: compile the model's forward with inductor at startup (worker.cpu_compile).
    cpu_compile: bool = False

    def __post_init__(self) -> None:
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        sched = self.scheduler
        max_len = self.model.max_model_len
        unchunked = not sched.enable_chunked_prefill
        if unchunked and max_len is not None and sched.max_num_batched_tokens < max_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked prefill is "
                f"disabled ({sched.max_num_batched_tokens} < {max_len})"
            )
