"""``ModelFacts``: what the engine core knows of the loaded model, sent once by the executor.

The core holds one executor and never touches a model or a device itself. What it needs of
the model (vocabulary, context length, EOS ids, KV blocks, names) arrives once as this plain
record, the same whether the model runs in the core's process or sharded over worker
processes. Workers build it; the executor hands it to the core.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.pooling_params import EmbedSpec


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the engine core knows about the loaded model (plain data, crosses processes)."""

    served_model_name: str
    arch: ModelArch
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", ...
    device: str  # rank 0's device ("cpu", "cuda:0")
    model_path: str  # the HF-format directory the weights came from
    tokenizer_path: str | None  # None: the model has no tokenizer (token ids only)
    num_blocks: int  # KV blocks every rank holds (the minimum over ranks)
    tensor_parallel_size: int = 1
    quantization: str | None = None  # the weight scheme; None: unquantized
    weight_bytes: int = 0  # bytes of weights on all ranks together, as loaded
    # KV cache bytes one token takes on each rank over all layers (K and V per KV head, or an
    # MLA model's latent); 0: no KV cache (an encoder).
    kv_bytes_per_token: int = 0
    # KV tiers: host-tier blocks (from --kv-offloading-size; 0: off) and bytes per KV block.
    num_offload_blocks: int = 0
    kv_block_bytes: int = 0
    # The disk tier: its records (0: off) and those a warm restart found, (hash, slot) oldest
    # first.
    num_disk_blocks: int = 0
    disk_entries: tuple[tuple[bytes, int], ...] = ()
    embed: EmbedSpec | None = None  # set: an embedding model (its pooler, Matryoshka sizes)
    encoder: bool = False  # a BERT-family encoder (bidirectional; prompts never chunked)

    @property
    def task(self) -> str:
        return "generate" if self.embed is None else self.embed.task

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size
