"""The sparse mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE.

``SparseMoeBlock`` (HF's ``mlp`` / Mixtral's ``block_sparse_moe``): a replicated router
``gate`` ([E, hidden] linear) picks each token's top-k experts (``kernels.moe.select_experts``),
``FusedMoE`` runs them (``kernels.moe.fused_moe``: Triton on CUDA, the torch reference on CPU),
and Qwen2-MoE adds a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.

Parameters: ``gate.weight`` [E, H]; ``experts.w13_weight`` [E, 2 * I, H] (each expert's gate
rows, then its up rows) and ``experts.w2_weight`` [E, H, I]; ``shared_expert.gate_up_proj`` /
``down_proj`` and ``shared_expert_gate.weight`` [1, H]. ``loading.map_name`` maps the HF
per-expert tensors into the stacked ones.

Tensor parallelism (as the dense MLP): every expert's intermediate dimension (and the shared
expert's) is split evenly over the ranks, so each rank holds ``I / tp`` rows of every expert's
gate and up and the matching columns of its down. The router is replicated, so every rank
routes identically; the routed and shared partial sums are added and all-reduced once.

gpt-oss: the router has a bias (``gate.bias``) and softmaxes the top-k logits only; the experts
have biases (``experts.w13_bias`` [E, 2 * I], split with their rows, and ``experts.w2_bias``
[E, H], replicated and added on rank 0 only, so the all-reduce counts it once) and run the
clamped SwiGLU. ``gpt_oss_checkpoint`` maps HF's fused, transposed expert tensors. An MXFP4
checkpoint's experts stay quantized where the Triton kernels run (``gpt_oss_mxfp4``:
``experts.mxfp4.*`` uint8 tensors instead of ``w13_weight`` / ``w2_weight``).

Llama 4: the top-k router logits through a sigmoid scale the chosen experts' input; its
shared expert (every token) is ungated. ``llama4_checkpoint`` maps HF's fused experts.

DeepSeek-V2/V3: the router's scores go through ``kernels.deepseek_routing.grouped_topk``
(float32 logits, as HF; V3's ``e_score_correction_bias`` [E], float32, replicated); the
shared experts are one ungated MLP (``deepseek_checkpoint`` renames ``shared_experts``).

Quantized schemes and LoRA do not cover the experts: building a MoE layer with a quantized
linear method is a ``ValueError`` (LoRA refuses MoE models in ``lora.manager``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenwire.kernels.activation import gated_activation
from tokenwire.kernels.deepseek_routing import grouped_topk
from tokenwire.kernels.moe import fused_moe, fused_moe_mxfp4, select_experts
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.models.arch import TP_FLAG, ModelArch
from tokenwire.runtime.models.gpt_oss_mxfp4 import MXFP4Experts, keeps_mxfp4
from tokenwire.runtime.models.layers import (
    LinearMethod,
    MergedColumnParallelLinear,
    RowParallelLinear,
    ShardedModule,
    ShardLoads,
)
from tokenwire.runtime.models.layers.basic import Linear
from tokenwire.runtime.models.moe_config import MoESpec
from tokenwire.runtime.models.weights import ShardLoad, split


class FusedMoE(ShardedModule):
    """The routed experts' stacked weights (this rank's share of each expert's width)."""

    def __init__(
        self, spec: MoESpec, hidden_size: int, act: str, dtype: torch.dtype, tp: TPGroup
    ) -> None:
        super().__init__()
        width = spec.intermediate_size
        if width % tp.world_size:
            raise ValueError(
                f"{TP_FLAG}={tp.world_size} does not divide the experts' intermediate size "
                f"({width}): choose a tensor-parallel size that divides it"
            )
        self.num_experts = spec.num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = width
        self.local_size = width // tp.world_size
        self.local_start = tp.rank * self.local_size
        self.activation = act
        local = self.local_size
        self.w13_weight: nn.Parameter | None = None
        self.w2_weight: nn.Parameter | None = None
        self.mxfp4: MXFP4Experts | None = None
        if keeps_mxfp4(spec.mxfp4_experts, hidden_size, local, tp.world_size):
            self.mxfp4 = MXFP4Experts(spec.num_experts, hidden_size, width, self.local_start, local)
        else:
            self.w13_weight = nn.Parameter(
                torch.empty(spec.num_experts, 2 * local, hidden_size, dtype=dtype)
            )
            self.w2_weight = nn.Parameter(
                torch.empty(spec.num_experts, hidden_size, local, dtype=dtype)
            )
        self.swiglu = spec.swiglu
        self.scale_input = spec.sigmoid_input_scaling
        self.add_down_bias = tp.rank == 0
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if spec.expert_bias:
            self.w13_bias = nn.Parameter(torch.empty(spec.num_experts, 2 * local, dtype=dtype))
            self.w2_bias = nn.Parameter(torch.empty(spec.num_experts, hidden_size, dtype=dtype))

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial sum of the routed experts' outputs [T, H]."""
        biases = None
        if self.w13_bias is not None:
            biases = (self.w13_bias, self.w2_bias if self.add_down_bias else None)
        activation = self.activation if self.swiglu is None else "swigluoai"
        if self.mxfp4 is not None:
            w13, w2 = self.mxfp4.pairs()
            return fused_moe_mxfp4(
                x, w13, w2, topk_weights, topk_ids, activation, biases, self.swiglu,
                interleaved=True,
            )  # fmt: skip
        assert self.w13_weight is not None and self.w2_weight is not None
        return fused_moe(
            x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, activation,
            biases, self.swiglu, self.scale_input,
        )  # fmt: skip

    def shard_loads(self) -> ShardLoads:
        """Expert ``e``'s gate/up rows and down columns of this rank (shard ids ``"e.gate"``,
        ``"e.up"``, ``"e.down"``)."""
        h, full = self.hidden_size, self.intermediate_size
        start, local = self.local_start, self.local_size
        w13: dict[str, ShardLoad] = {}
        w2: dict[str, ShardLoad] = {}
        b13: dict[str, ShardLoad] = {}
        b2: dict[str, ShardLoad] = {}
        for e in range(self.num_experts):
            for i, part in enumerate(("gate", "up")):
                w13[f"{e}.{part}"] = split((full, h), 0, start, local, i * local, dst_index=e)
                b13[f"{e}.{part}"] = split((full,), 0, start, local, i * local, dst_index=e)
            w2[f"{e}.down"] = split((h, full), 1, start, local, dst_index=e)
            b2[f"{e}.down"] = ShardLoad((h,), dst_index=e)
        loads: ShardLoads = {} if self.mxfp4 is not None else {"w13_weight": w13, "w2_weight": w2}
        if self.w13_bias is not None:
            loads.update(w13_bias=b13, w2_bias=b2)
        return loads


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a gated MLP whose ``down_proj`` does not all-reduce (the
    block reduces its sum with the routed experts' once)."""

    def __init__(self, arch: ModelArch, width: int, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        what = "shared_expert_intermediate_size"
        sizes = {"gate": width, "up": width}
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, sizes, False, dtype, tp, what
        )
        self.down_proj = RowParallelLinear(width, arch.hidden_size, False, dtype, tp, what)
        self.act_and_mul = gated_activation(arch.hidden_act)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product (the full output at TP=1)."""
        down = self.down_proj
        return down.linear_method.apply(down, self.act_and_mul(self.gate_up_proj(x)), None)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's gated shared expert); one all-reduce."""

    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        tp: TPGroup,
        method: LinearMethod | None,
    ) -> None:
        super().__init__()
        spec = arch.moe
        assert spec is not None, "SparseMoeBlock needs a MoE architecture"
        if method is not None and method.name:
            raise ValueError(
                f"quantization {method.name!r} is not supported for mixture-of-experts models "
                f"({arch.architecture}): the experts run unquantized only; drop --quantization "
                "(or serve an unquantized checkpoint)"
            )
        self.tp = tp
        self.top_k = spec.top_k
        self.renormalize = spec.renormalize
        self.softmax_after_topk = spec.softmax_after_topk
        self.sigmoid_topk = spec.sigmoid_input_scaling
        self.gate = Linear(arch.hidden_size, spec.num_experts, spec.router_bias, dtype)
        self.deepseek = spec.deepseek
        self.e_score_correction_bias: nn.Parameter | None = None
        if spec.deepseek is not None and spec.deepseek.correction_bias:
            bias = torch.zeros(spec.num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        self.experts = FusedMoE(spec, arch.hidden_size, arch.hidden_act, dtype, tp)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: Linear | None = None
        if spec.has_shared_expert:
            width = spec.shared_expert_intermediate_size
            self.shared_expert = SharedExpert(arch, width, dtype, tp)
            if spec.shared_expert_gated:
                self.shared_expert_gate = Linear(arch.hidden_size, 1, False, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights [T, k], expert ids [T, k]) of each token."""
        routing = self.deepseek
        if routing is None:
            logits = self.gate(x)
            return select_experts(
                logits, self.top_k, self.renormalize, self.softmax_after_topk, self.sigmoid_topk
            )
        return grouped_topk(
            F.linear(x.float(), self.gate.weight.float()), self.top_k, routing.num_groups,
            routing.topk_groups, sigmoid=routing.sigmoid, group_top2_sum=routing.group_top2_sum,
            renormalize=self.renormalize, routed_scaling_factor=routing.routed_scaling_factor,
            correction_bias=self.e_score_correction_bias,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out: torch.Tensor = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert.partial(x)
            if self.shared_expert_gate is not None:
                shared = F.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if self.tp.world_size > 1:
            out = self.tp.all_reduce(out)
        return out
