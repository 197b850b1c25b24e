"""The physical floor of a benchmark: bytes every decode step must read and prefill FLOPs.

Ceilings are the H200's, measured on the benchmark box (issue 6): 4.25 TB/s device copy and
790 TFLOP/s bf16 matmul. The floor of a workload is

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
from collections.abc import Sequence
from dataclasses import dataclass

from tokenwire.runtime.models.arch import ModelArch

H200_BANDWIDTH_BYTES_S = 4.25e12
H200_BF16_FLOPS = 790e12


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # read by one decode step
    kv_bytes_per_token: int  # K and V of one token, all layers
    matmul_params: int  # per-token matmul parameters, LM head excluded


def model_cost(arch: ModelArch, dtype_bytes: int) -> ModelCost:
    hidden, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    per_layer += 2 * hidden + (2 * arch.head_dim if arch.qk_norm else 0)  # norms
    per_layer += (q + 2 * kv) if arch.attention_bias else 0
    per_layer += hidden if arch.o_proj_bias else 0
    body = arch.num_hidden_layers * per_layer + hidden  # + final norm
    lm_head = arch.vocab_size * hidden
    kv_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim
    return ModelCost(
        weight_bytes=(body + lm_head) * dtype_bytes,
        kv_bytes_per_token=kv_token * dtype_bytes,
        matmul_params=body,
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
    bandwidth: float = H200_BANDWIDTH_BYTES_S,
    flops: float = H200_BF16_FLOPS,
) -> Floor:
    steps = decode_steps(output_lens, max_num_seqs)
    kv_tokens = sum(
        (o - 1) * p + (o - 1) * o // 2 for p, o in zip(prompt_lens, output_lens, strict=True)
    )
    weight_read = float(steps) * cost.weight_bytes
    kv_read = float(kv_tokens) * cost.kv_bytes_per_token
    prefill = 2.0 * cost.matmul_params * sum(prompt_lens)
    seconds = (weight_read + kv_read) / bandwidth + prefill / flops
    return Floor(seconds, sum(output_lens), steps, weight_read, kv_read, prefill)


def decode_step_floor_s(
    cost: ModelCost, context_lens: Sequence[int], bandwidth: float = H200_BANDWIDTH_BYTES_S
) -> float:
    """One decode step over sequences of these context lengths (batch 1: TPOT floor)."""
    return (cost.weight_bytes + sum(context_lens) * cost.kv_bytes_per_token) / bandwidth
