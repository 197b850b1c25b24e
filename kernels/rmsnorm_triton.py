"""Triton RMSNorm, plain and fused with the residual add: one program per row.

Grid ``(num_rows,)``; a program holds its whole row (``BLOCK = next_pow2(hidden)``, masked), so
the variance is one in-register reduction. Numerics mirror the reference: the residual add
happens in the input dtype (one rounding, as torch does), variance and scaling in float32,
the normalized row is rounded to the input dtype before the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenwire.kernels.dispatch import next_power_of_2


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Add in float32 and round once: what torch's bf16/fp16 add does, and arithmetic the
        # interpreter also supports for bf16 (it holds bf16 as raw bits).
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * N + offs, x, mask=mask)
    hidden = x.to(tl.float32)
    variance = tl.sum(hidden * hidden, axis=0) / N
    normed = (hidden * tl.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * N + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, N]`` with a unit last stride (copies only when it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else None
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    new_residual = torch.empty_like(x2) if r2 is not None else None
    block = next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2 if r2 is not None else x2,  # unused when HAS_RESIDUAL is False
        weight,
        out,
        new_residual if new_residual is not None else out,
        x2.stride(0),
        r2.stride(0) if r2 is not None else 0,
        eps,
        N=hidden,
        BLOCK=block,
        HAS_RESIDUAL=r2 is not None,
        num_warps=min(16, max(1, block // 512)),
    )
    out = out.view(x.shape)
    return out, new_residual.view(x.shape) if new_residual is not None else None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``rms_norm_ref``."""
    if x.numel() == 0:
        return torch.empty(
            x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device
        )
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``fused_add_rms_norm_ref``: ``(norm(x + residual), x + residual)``."""
    if x.numel() == 0:
        return rms_norm_triton(x, weight, eps), residual + x
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual
