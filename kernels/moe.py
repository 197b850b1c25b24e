"""Mixture-of-experts MLP: top-k routing and the experts' gated MLPs, weighted and summed.

- ``select_experts``: softmax over the router logits (float32), the top-k experts per token,
  optionally renormalised so each token's k weights sum to 1 (Mixtral always; Qwen MoE with
  ``norm_topk_prob``), as HF's routers compute them.
- ``fused_moe``: ``out[t] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))`` with
  ``e = ids[t, j]``, the experts' weights stacked as ``w_gate_up [E, 2 * I, H]`` (gate rows,
  then up rows) and ``w_down [E, H, I]``. Triton (``moe_triton``) on CUDA and under
  ``TRITON_INTERPRET=1``, else the torch reference.
- gpt-oss: routing by ``softmax_after_topk`` (the top-k logits, then a softmax over just
  them), per-expert biases on both projections and the clamped SwiGLU ``swigluoai``
  (``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``);
  both paths.
- Llama 4: ``sigmoid_topk`` routing (the top-k logits through a sigmoid, no softmax) and
  ``scale_input``: each chosen expert runs on ``w * x`` and its output is added unweighted
  (HF's ``Llama4TextMoe``); both paths.

The reference runs HF's loop (experts in ascending order, each over the rows routed to it,
``index_add_`` into the output), so on CPU float32 it adds the same products in the same order
as transformers. Under tensor parallelism ``I`` is this rank's share and the result is a
partial sum (the caller all-reduces).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from tokenwire.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from tokenwire.kernels.dispatch import use_triton

_REFERENCE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul_ref,
    "gelu_pytorch_tanh": gelu_tanh_and_mul_ref,
}


def swiglu_oai_and_mul_ref(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU over ``[..., 2 * I]`` (gate half, then up half), as HF's
    ``GptOssExperts._apply_gate`` computes it (HF interleaves gate/up; the loader splits)."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


# (gate_up bias [E, 2I], down bias [E, H] or None) of experts with biases (gpt-oss).
MoEBiases = tuple[torch.Tensor, torch.Tensor | None]
# (uint8 blocks [E, N, K / 32, 16], uint8 scales [E, N, K / 32]) of MXFP4 experts (gpt-oss).
MXFP4Weight = tuple[torch.Tensor, torch.Tensor]


def _activation(
    activation: str, swiglu: tuple[float, float] | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    if activation == "swigluoai":
        if swiglu is None:
            raise ValueError("the swigluoai activation needs swiglu=(alpha, limit)")
        return partial(swiglu_oai_and_mul_ref, alpha=swiglu[0], limit=swiglu[1])
    if activation not in _REFERENCE_ACTIVATIONS:
        raise ValueError(
            f"unsupported MoE activation {activation!r}; supported: "
            + ", ".join((*_REFERENCE_ACTIVATIONS, "swigluoai"))
        )
    return _REFERENCE_ACTIVATIONS[activation]


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    softmax_after_topk: bool = False,
    sigmoid_topk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (float32 weights [T, k], int64 expert ids [T, k]).

    ``softmax_after_topk`` (gpt-oss): the top-k logits, then a softmax over those k.
    ``sigmoid_topk`` (Llama 4): the top-k logits, each through a sigmoid."""
    if sigmoid_topk:
        top, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.sigmoid(top.float()), ids
    if softmax_after_topk:
        top, ids = torch.topk(router_logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_moe_shapes(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """Raise ValueError unless the operands fit together (see ``fused_moe``)."""
    if hidden.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError("fused_moe wants hidden [T, H], w_gate_up [E, 2I, H], w_down [E, H, I]")
    t, h = hidden.shape
    e, two_i, k_in = w_gate_up.shape
    if k_in != h or two_i % 2 or tuple(w_down.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"fused_moe shapes do not fit: hidden {tuple(hidden.shape)}, w_gate_up "
            f"{tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [T={t}, k]"
        )


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    biases: MoEBiases | None = None,
    swiglu: tuple[float, float] | None = None,
    scale_input: bool = False,
) -> torch.Tensor:
    """The routed experts' weighted sum [T, H] in ``hidden``'s dtype (see the module doc).

    ``biases``: (gate_up [E, 2I], down [E, H]) per-expert biases (down may be None: a
    tensor-parallel rank other than 0). ``swiglu``: (alpha, limit) of ``swigluoai``.
    ``scale_input`` (Llama 4): the weights scale each expert's input, not its output."""
    _activation(activation, swiglu)  # raises for an unknown activation or missing swiglu
    if use_triton(hidden):
        from tokenwire.kernels.moe_triton import fused_moe_triton

        return fused_moe_triton(
            hidden, w_gate_up, w_down, topk_weights, topk_ids, activation,
            scale_input=scale_input, biases=biases, swiglu=swiglu,
        )  # fmt: skip
    return fused_moe_ref(
        hidden, w_gate_up, w_down, topk_weights, topk_ids, activation, biases, swiglu,
        scale_input,
    )  # fmt: skip


def fused_moe_mxfp4(
    hidden: torch.Tensor,
    w13: MXFP4Weight,
    w2: MXFP4Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    biases: MoEBiases | None = None,
    swiglu: tuple[float, float] | None = None,
    interleaved: bool = False,
) -> torch.Tensor:
    """``fused_moe`` over experts kept in MXFP4 (``moe_mxfp4_triton``): Triton only (CUDA or
    the interpreter); the torch path runs de-quantized weights through ``fused_moe``.
    ``interleaved``: ``w13``'s rows alternate gate, up (the gpt-oss checkpoint's order)."""
    _activation(activation, swiglu)
    if not use_triton(hidden):
        raise ValueError("MXFP4 experts run in Triton only (CUDA or TRITON_INTERPRET=1)")
    from tokenwire.kernels.moe_mxfp4_triton import fused_moe_mxfp4_triton

    return fused_moe_mxfp4_triton(
        hidden, w13, w2, topk_weights, topk_ids, activation, biases=biases, swiglu=swiglu,
        interleaved=interleaved,
    )  # fmt: skip


def fused_moe_ref(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    biases: MoEBiases | None = None,
    swiglu: tuple[float, float] | None = None,
    scale_input: bool = False,
) -> torch.Tensor:
    """Torch reference: per expert, a gathered matmul over the rows routed to it."""
    check_moe_shapes(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    act_and_mul = _activation(activation, swiglu)
    b13, b2 = biases if biases is not None else (None, None)
    out = torch.zeros_like(hidden)
    num_experts = w_gate_up.shape[0]
    # [E, k, T]: which (slot, token) pairs chose each expert (HF's expert mask).
    mask = F.one_hot(topk_ids, num_experts).permute(2, 1, 0)
    hit = mask.sum(dim=(1, 2)).nonzero().flatten().tolist()
    for expert in hit:
        slot, token = torch.where(mask[expert])
        x = hidden[token]
        weight = topk_weights[token, slot, None]
        if scale_input:
            x = x * weight.to(x.dtype)
        gate_up = F.linear(x, w_gate_up[expert], None if b13 is None else b13[expert])
        y = F.linear(act_and_mul(gate_up), w_down[expert], None if b2 is None else b2[expert])
        if not scale_input:
            y = y * weight
        out.index_add_(0, token, y.to(out.dtype))
    return out
