"""Triton SiLU-and-mul: ``silu(gate) * up`` for ``x = [..., 2 * I]`` (gate then up).

Grid ``(num_rows, cdiv(I, BLOCK))``: each program handles ``BLOCK`` columns of one row, so
wide intermediates (14336 for 8B) spread over several programs. Math in float32, one rounding
to the output dtype at the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenwire.kernels.dispatch import next_power_of_2

_MAX_BLOCK = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    stride_x,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * INTER + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``silu_and_mul_ref``."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        block = min(_MAX_BLOCK, next_power_of_2(inter))
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), INTER=inter, BLOCK=block)
    return out.view(*x.shape[:-1], inter)
