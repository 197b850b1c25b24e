"""The physical floor of a benchmark: bytes every decode step must read and prefill FLOPs.

The ceilings come from ``DEVICES``, a small per-device table picked by the CUDA device name
(``lookup_device``); on any other device (the CPU included) there is no floor. The floor of a
workload is

    time = (decode_steps * weight_bytes + kv_read_bytes) / bandwidth + prefill_flops / flops

- ``weight_bytes``: every matmul weight plus the LM head, read once per decode step (the
  embedding table is gathered, a few rows per step, unless tied to the LM head);
- ``kv_read_bytes``: decode token ``k`` of a request with ``p`` prompt tokens attends to
  ``p + k`` cached tokens (``k = 1 .. output_len - 1``: the first output token comes from the
  prefill step), ``kv_bytes_per_token`` each;
- ``decode_steps``: continuous batching with ``max_num_seqs`` slots, requests admitted in
  order as slots free up, one token per running request per step (list-scheduling makespan);
- ``prefill_flops``: 2 FLOPs per matmul parameter per prompt token (LM head excluded: only the
  last prompt token needs logits).
Pure Python over ``ModelArch``: unit-tested on CPU against the issue's published floors.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Sequence
from dataclasses import dataclass

from tokenwire.runtime.models.arch import ModelArch


@dataclass(frozen=True)
class DeviceCeilings:
    """One accelerator's ceilings. ``hbm_bytes_s`` and ``bf16_flops`` are the vendor datasheet
    figures (dense bf16 tensor-core FLOP/s, i.e. half the "with sparsity" figure); where the
    device was measured on a benchmark box, ``measured_*`` hold those figures and the floor
    uses them (``bandwidth`` / ``flops``)."""

    name: str
    match: frozenset[str]  # tokens that must all appear in the CUDA device name
    hbm_bytes_s: float
    bf16_flops: float
    measured_bytes_s: float | None = None
    measured_bf16_flops: float | None = None

    @property
    def bandwidth(self) -> float:
        """Bytes/s the floor assumes: measured where known, else the datasheet figure."""
        return self.measured_bytes_s or self.hbm_bytes_s

    @property
    def flops(self) -> float:
        return self.measured_bf16_flops or self.bf16_flops

    @property
    def basis(self) -> str:
        return "measured" if self.measured_bytes_s else "datasheet"


def _device(
    name: str,
    match: str,
    tb_s: float,
    tflops: float,
    measured_tb_s: float | None = None,
    measured_tflops: float | None = None,
) -> DeviceCeilings:
    return DeviceCeilings(
        name,
        frozenset(match.split()),
        tb_s * 1e12,
        tflops * 1e12,
        None if measured_tb_s is None else measured_tb_s * 1e12,
        None if measured_tflops is None else measured_tflops * 1e12,
    )


# NVIDIA datasheet figures: memory bandwidth (TB/s) and dense BF16 tensor-core TFLOP/s (the
# datasheets print BF16 "with sparsity"; dense is half). First match wins, so the specific
# variants come before the family's default. CUDA device names: "NVIDIA H200",
# "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S", ...
DEVICES: tuple[DeviceCeilings, ...] = (
    # H200 NVL datasheet: 4.8 TB/s HBM3e, BF16 1,671 TFLOPS with sparsity.
    _device("H200-NVL", "H200 NVL", 4.8, 835.5),
    # H200 SXM datasheet: 4.8 TB/s HBM3e, BF16 1,979 TFLOPS with sparsity. Measured on the
    # benchmark box (issue 6): 4.25 TB/s device copy, 790 TFLOP/s bf16 matmul; issue 6's
    # floors and targets (and scripts/gpu_check.py) use these.
    _device("H200", "H200", 4.8, 989.5, measured_tb_s=4.25, measured_tflops=790.0),
    # H100 NVL: 3.9 TB/s, BF16 1,671 sparse. H100 PCIe: 2.0 TB/s, 1,513 sparse.
    _device("H100-NVL", "H100 NVL", 3.9, 835.5),
    _device("H100-PCIe", "H100 PCIE", 2.0, 756.5),
    # H100 SXM5 80GB datasheet: 3.35 TB/s HBM3, BF16 1,979 TFLOPS with sparsity.
    _device("H100-SXM", "H100", 3.35, 989.5),
    # A100 datasheet: BF16 312 TFLOPS dense; 80GB SXM 2,039 GB/s, 80GB PCIe 1,935 GB/s,
    # 40GB 1,555 GB/s.
    _device("A100-80GB-PCIe", "A100 80GB PCIE", 1.935, 312.0),
    _device("A100-80GB-SXM", "A100 80GB", 2.039, 312.0),
    _device("A100-40GB", "A100", 1.555, 312.0),
    # L40S datasheet: 864 GB/s GDDR6, BF16 362.05 TFLOPS dense (733 with sparsity).
    _device("L40S", "L40S", 0.864, 362.05),
    # L4 datasheet: 300 GB/s GDDR6, BF16 242 TFLOPS with sparsity.
    _device("L4", "L4", 0.300, 121.0),
)
H200 = next(d for d in DEVICES if d.name == "H200")


def lookup_device(device_name: str) -> DeviceCeilings | None:
    """The table entry for a CUDA device name (``torch.cuda.get_device_name()``) or a table
    name (``H100-SXM``); None for any other device (no floor)."""
    for d in DEVICES:
        if d.name.upper() == device_name.upper():
            return d
    tokens = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for d in DEVICES:
        if d.match <= tokens:
            return d
    return None


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # read by one decode step (MoE: every expert, as at large batches)
    kv_bytes_per_token: int  # K and V of one token, all layers
    matmul_params: int  # per-token matmul parameters, LM head excluded (MoE: top-k experts)
    # MoE: bytes of the routed experts (inside weight_bytes), and the fraction of them one
    # token uses (top_k / num_experts); a step of B tokens reads 1 - (1 - f) ** B of them.
    routed_expert_bytes: int = 0
    routed_fraction: float = 1.0

    def step_weight_bytes(self, batch: int) -> float:
        """Weights one decode step of ``batch`` tokens reads (uniform routing expected)."""
        touched = 1.0 - (1.0 - self.routed_fraction) ** max(1, batch)
        return self.weight_bytes - self.routed_expert_bytes * (1.0 - touched)


def _mlp_params(arch: ModelArch, layer: int) -> tuple[int, int, int]:
    """(parameters, per-token parameters, routed-expert parameters) of one layer's MLP."""
    hidden, moe = arch.hidden_size, arch.moe
    if moe is None or not arch.layer_is_sparse(layer):
        dense = 3 * hidden * arch.intermediate_size
        return dense, dense, 0
    expert = 3 * hidden * moe.intermediate_size
    common = hidden * moe.num_experts + 3 * hidden * moe.shared_expert_intermediate_size
    common += hidden if moe.has_shared_expert else 0  # the shared expert's gate
    routed = expert * moe.num_experts
    return common + routed, common + expert * moe.top_k, routed


def _attention_params(arch: ModelArch) -> int:
    """One layer's attention parameters (projections, their biases, q/k norms; gpt-oss's
    sinks); MLA's are its low-rank projections and their norms."""
    hidden, heads, mla = arch.hidden_size, arch.num_attention_heads, arch.mla
    if mla is not None:
        q_out = heads * mla.qk_head_dim
        rank = mla.q_lora_rank
        params = hidden * q_out if rank is None else hidden * rank + rank + rank * q_out
        params += hidden * mla.latent_dim + mla.kv_lora_rank  # kv_a_proj_with_mqa + its norm
        params += mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        return params + heads * mla.v_head_dim * hidden  # o_proj
    q, kv = arch.q_size, arch.kv_size
    params = hidden * (q + 2 * kv) + q * hidden + (2 * arch.head_dim if arch.qk_norm else 0)
    params += (q + 2 * kv) if arch.attention_bias else 0
    params += hidden if arch.o_proj_bias else 0
    return params + (heads if arch.attention_sinks else 0)


def model_cost(arch: ModelArch, dtype_bytes: int) -> ModelCost:
    """Weight, KV and matmul sizes; MLA caches ``kv_lora_rank + rope`` features per token and
    layer (``kv_cache_parts`` = 1: keys and values are one latent)."""
    hidden = arch.hidden_size
    per_layer = _attention_params(arch) + 2 * hidden  # + the two layer norms
    mlps = [_mlp_params(arch, i) for i in range(arch.num_hidden_layers)]
    body = arch.num_hidden_layers * per_layer + hidden  # + final norm
    active = body + sum(m[1] for m in mlps)
    body += sum(m[0] for m in mlps)
    lm_head = arch.vocab_size * hidden
    kv_token = arch.kv_cache_parts * arch.num_hidden_layers * arch.kv_size
    moe = arch.moe
    return ModelCost(
        weight_bytes=(body + lm_head) * dtype_bytes,
        kv_bytes_per_token=kv_token * dtype_bytes,
        matmul_params=active,
        routed_expert_bytes=sum(m[2] for m in mlps) * dtype_bytes,
        routed_fraction=1.0 if moe is None else moe.top_k / moe.num_experts,
    )


def decode_steps(output_lens: Sequence[int], max_num_seqs: int) -> int:
    """Steps to finish every request when at most ``max_num_seqs`` run at once."""
    slots = [0] * min(max_num_seqs, max(1, len(output_lens)))
    end = 0
    for n in output_lens:
        start = heapq.heappop(slots)
        end = max(end, start + n)
        heapq.heappush(slots, start + n)
    return end


@dataclass(frozen=True)
class Floor:
    seconds: float
    output_tokens: int
    decode_steps: int
    weight_read_bytes: float
    kv_read_bytes: float
    prefill_flops: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("inf")


def workload_floor(
    cost: ModelCost,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    max_num_seqs: int,
    device: DeviceCeilings,
) -> Floor:
    steps = decode_steps(output_lens, max_num_seqs)
    kv_tokens = sum(
        (o - 1) * p + (o - 1) * o // 2 for p, o in zip(prompt_lens, output_lens, strict=True)
    )
    weight_read = float(steps) * cost.weight_bytes
    kv_read = float(kv_tokens) * cost.kv_bytes_per_token
    prefill = 2.0 * cost.matmul_params * sum(prompt_lens)
    seconds = (weight_read + kv_read) / device.bandwidth + prefill / device.flops
    return Floor(seconds, sum(output_lens), steps, weight_read, kv_read, prefill)


def decode_step_floor_s(
    cost: ModelCost, context_lens: Sequence[int], device: DeviceCeilings
) -> float:
    """One decode step over sequences of these context lengths (batch 1: TPOT floor)."""
    weights = cost.step_weight_bytes(len(context_lens))
    return (weights + sum(context_lens) * cost.kv_bytes_per_token) / device.bandwidth
