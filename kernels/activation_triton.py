"""Triton gated activations: ``act(gate) * up`` for ``x = [..., 2 * I]`` (gate then up).

``ACT`` selects SiLU (0) or the tanh approximation of GELU (1). Grid ``(num_rows,
cdiv(I, BLOCK))``: each program handles ``BLOCK`` columns of one row, so wide intermediates
(14336 for 8B) spread over several programs. Math in float32, one rounding to the output
dtype at the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenwire.kernels.dispatch import next_power_of_2

_MAX_BLOCK = 1024  # columns per program
_SILU = 0
_GELU_TANH = 1


@triton.jit
def _act_and_mul_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    stride_x,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    ACT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi)
        # tanh from exp(-2|y|) <= 1: no overflow for any y.
        t = tl.exp(-2.0 * tl.abs(inner))
        tanh_abs = (1.0 - t) / (1.0 + t)
        act = 0.5 * gate * (1.0 + tl.where(inner >= 0, tanh_abs, -tanh_abs))
    out = act * up
    tl.store(out_ptr + row * INTER + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, act: int) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        block = min(_MAX_BLOCK, next_power_of_2(inter))
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _act_and_mul_kernel[grid](x2, out, x2.stride(0), INTER=inter, BLOCK=block, ACT=act)
    return out.view(*x.shape[:-1], inter)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``silu_and_mul_ref``."""
    return _act_and_mul(x, _SILU)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``gelu_tanh_and_mul_ref`` (float32 math; not bit-identical)."""
    return _act_and_mul(x, _GELU_TANH)
