"""The seam between fronts (gRPC server, REST via gRPC, benchmarks) and the engine.

A front sees only ``EngineClient`` (and its ``Frontend``, the text side), the plain
``EngineInfo`` record it publishes once started, and the ``EngineStatsSnapshot`` it publishes
after every step. Whether the engine core runs on a thread of this process or in a process of
its own is the client's business.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tokenwire.runtime.front.tokenizer import Tokenizer
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.pooling_params import EmbedSpec
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import KVOffloadStats

if TYPE_CHECKING:
    from tokenwire.runtime.front.frontend import Frontend
    from tokenwire.runtime.front.kv_event_hub import KVEventStream
    from tokenwire.runtime.front.request_stream import RequestStream
    from tokenwire.runtime.multimodal import ImageInput


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Facts about the served model and engine, fixed once the core has loaded the model."""

    served_model_name: str
    architecture: str
    dtype: str
    device: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    quantization: str | None  # the weights' scheme; None: not quantized
    tensor_parallel_size: int
    # Where the front loads the tokenizer (and chat template) from; None: token ids only.
    tokenizer_path: str | None
    core_pid: int  # the process running the engine core (this one when in-process)
    weight_bytes: int = 0  # the model's weights as loaded (all ranks together)
    kv_bytes_per_token: int = 0  # KV cache bytes per token on each rank (MLA: the latent)
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; "fp8": e4m3
    max_loras: int = 0  # adapters one step can serve; 0: LoRA is not enabled
    max_lora_rank: int = 0
    # Adapters loaded at startup (--lora-modules); later loads and unloads go through
    # ``EngineClient.add_lora`` / ``remove_lora`` and show in ``list_loras``.
    lora_adapters: tuple[LoRARequest, ...] = ()
    # --chat-template's Jinja text (None: the tokenizer's own); the front sets it on its
    # tokenizer, so every chat rendered there uses it.
    chat_template: str | None = None
    # --allow-content-special-tokens: user and tool content may hold special tokens.
    allow_content_special_tokens: bool = False
    # --generation-config: SamplingParams field -> default for requests leaving it unset
    # (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens); empty: built-ins.
    default_sampling: dict[str, float | int] = field(default_factory=dict)
    # Set: an embedding model (``task == "embed"``): its pooler and Matryoshka sizes.
    embed: EmbedSpec | None = None
    # --data-parallel-size > 1: each core's KV blocks, by rank (``num_kv_blocks`` is one
    # core's: what one request may use); empty with one core.
    rank_kv_blocks: tuple[int, ...] = ()
    # The HF-format directory the weights came from: the front loads a vision-language
    # model's image processor from it ("": none).
    model_path: str = ""

    @property
    def data_parallel_size(self) -> int:
        return max(1, len(self.rank_kv_blocks))

    @property
    def task(self) -> str:
        return "generate" if self.embed is None else self.embed.task

    @property
    def embedding_dimensions(self) -> int:
        """The full embedding size; 0 for a generation model."""
        return 0 if self.embed is None else self.embed.hidden_size


@dataclass(frozen=True, slots=True)
class EngineStatsSnapshot:
    """Scheduler and KV-cache state after a step, for gauges (counters are cumulative)."""

    step_id: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    num_held_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found
    num_preemptions: int = 0
    # Adapter names of the running / waiting requests (vLLM's lora_requests_info gauge).
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # KV tiers: the host tier's state and counters; None when --kv-offloading-size is off.
    kv_offload: KVOffloadStats | None = None
    # --data-parallel-size > 1: each core's own snapshot, by rank (this one is their sum);
    # empty with one core.
    ranks: tuple[EngineStatsSnapshot, ...] = ()


@dataclass(frozen=True, slots=True)
class IdleReport:
    """The core's own account of its state, asked for after every earlier command applied."""

    has_unfinished_requests: bool
    num_free_blocks: int
    num_blocks: int
    num_held_blocks: int
    invariant_error: str | None  # None: tables, ref counts and free queue agree
    num_tier_held_blocks: int = 0  # KV tiers: host blocks pinned by Sessions that moved down

    @property
    def all_free(self) -> bool:
        """No request, no held table, every block free, invariants intact."""
        return (
            not self.has_unfinished_requests
            and self.num_free_blocks == self.num_blocks
            and self.num_held_blocks == 0
            and self.num_tier_held_blocks == 0
            and self.invariant_error is None
        )


class EngineClient(Protocol):
    """What every front uses. Methods run on the front's event loop; ``add_request`` raises
    ``ParameterError``, ``DuplicateRequestError``, ``QueueFullError``, ``NotReadyError``,
    ``DrainingError`` or ``EngineDeadError`` before anything is queued."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def frontend(self) -> Frontend:
        """The text pipeline (tokenizer, chat rendering) once started; a server runs its
        ``encode`` and ``render_chat`` off the event loop."""
        ...

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def is_dead(self) -> bool: ...

    @property
    def num_in_flight(self) -> int: ...

    async def start(self) -> None: ...

    async def warmup(self) -> None: ...

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        hold_as: str | None = None,
        lora_request: LoRARequest | None = None,
        data_parallel_rank: int | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> RequestStream:
        """``data_parallel_rank``: run on that engine core (``ParameterError`` naming
        ``data_parallel_rank`` outside ``[0, info.data_parallel_size)``); None: balanced.
        ``images``: the prompt's images, placeholders expanded (``Frontend.render_chat_images``)."""
        ...

    async def check_constraint(self, params: SamplingParams) -> None:
        """The costly checks of ``params`` (parsing a structured-output constraint), off
        the event loop; ``ParameterError`` naming the field. ``add_request`` does only cheap
        checks and leaves a constraint it has not seen checked to the engine core."""
        ...

    def abort(self, request_id: str) -> bool: ...

    # LoRA adapters (``info.max_loras == 0``: LoRA is not enabled and none is ever listed).
    def get_lora(self, name: str) -> LoRARequest | None:
        """The loaded adapter called ``name`` (what a request's ``model`` selects)."""
        ...

    def list_loras(self) -> list[LoRARequest]:
        """Loaded adapters, in load order."""
        ...

    async def add_lora(self, name: str, path: str) -> LoRARequest:
        """Load a PEFT adapter directory under ``name``. The engine validates it against
        the model first: ``AdapterError`` (bad adapter, or LoRA not enabled) or
        ``AdapterExistsError``; the engine serves on either way."""
        ...

    async def remove_lora(self, name: str) -> None:
        """Unload ``name`` (``AdapterNotFoundError`` if none): new requests can no longer
        select it at once; requests already using it run to completion first."""
        ...

    def release_holder(self, holder_id: str) -> None: ...

    def on_holder_evicted(self, holder_id: str, callback: Callable[[], None]) -> None: ...

    def on_dead(self, callback: Callable[[], None]) -> None: ...

    def stats_snapshot(self) -> EngineStatsSnapshot: ...

    async def check_idle(self, timeout: float = 30.0) -> IdleReport: ...

    @property
    def kv_events(self) -> KVEventStream | None:
        """The KV-cache event stream (None unless ``--kv-events-config`` enables it): the one
        core's hub, or with several engine cores every rank's batches merged
        (``front.kv_event_merge``)."""
        ...

    async def reset_prefix_cache(self, timeout: float = 30.0) -> bool:
        """Forget every cached block (an ``AllBlocksCleared`` event); False while in use."""
        ...

    async def wait_idle(self, timeout: float) -> bool: ...

    async def drain(self, timeout: float) -> None: ...

    async def shutdown(self) -> None: ...
