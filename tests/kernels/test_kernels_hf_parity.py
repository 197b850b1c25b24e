"""RMSNorm, rotary embedding and silu_and_mul against HF transformers' Llama modules.

RMSNorm and rotary follow HF's op order, so they must match bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tokenwire.kernels.activation import silu_and_mul
from tokenwire.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from tokenwire.kernels.rotary import apply_rotary, build_cos_sin_cache, compute_inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf_bitwise(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    hf = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1.0 + 0.1 * torch.randn(576, generator=gen))
    x = (3.0 * torch.randn(13, 576, generator=gen)).to(dtype)
    residual = torch.randn(13, 576, generator=gen).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, hf.weight, 1e-5), hf(x))
        normed, new_residual = fused_add_rms_norm(x, residual, hf.weight, 1e-5)
        assert torch.equal(new_residual, residual + x)
        assert torch.equal(normed, hf(residual + x))


ROPE_CASES = [
    (64, 10000.0, None),
    (64, 100000.0, {"rope_type": "default"}),
    (8, 1000000.0, None),
    (32, 10000.0, {"rope_type": "linear", "factor": 4.0}),
    (
        128,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
]


def hf_rope_config(head_dim: int, theta: float, scaling: dict[str, object] | None) -> LlamaConfig:
    params = dict(scaling or {"rope_type": "default"})
    params["rope_theta"] = theta
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=16384,
        rope_parameters=params,
    )


@pytest.mark.parametrize(("head_dim", "theta", "scaling"), ROPE_CASES)
def test_inv_freq_matches_hf_rope_init(
    head_dim: int, theta: float, scaling: dict[str, object] | None
) -> None:
    config = hf_rope_config(head_dim, theta, scaling)
    rope_type = (scaling or {}).get("rope_type", "default")
    expect: torch.Tensor
    if rope_type == "default":
        expect = LlamaRotaryEmbedding(config).inv_freq
    else:
        expect, attention_factor = ROPE_INIT_FUNCTIONS[str(rope_type)](config)
        assert attention_factor == 1.0  # why the cache carries no attention scaling
    assert torch.equal(compute_inv_freq(head_dim, theta, scaling), expect)


@pytest.mark.parametrize(("head_dim", "theta", "scaling"), ROPE_CASES)
@pytest.mark.parametrize("num_tokens", [1, 7, 333, 8192])
def test_apply_rotary_matches_hf_bitwise(
    head_dim: int, theta: float, scaling: dict[str, object] | None, num_tokens: int
) -> None:
    """Max abs difference to HF is exactly 0 for positions up to 8191."""
    gen = torch.Generator().manual_seed(7)
    hf = LlamaRotaryEmbedding(hf_rope_config(head_dim, theta, scaling))
    cache = build_cos_sin_cache(compute_inv_freq(head_dim, theta, scaling), 8192, torch.float32)
    if num_tokens == 8192:
        positions = torch.arange(8192)
    else:
        positions = torch.randint(0, 8192, (num_tokens,), generator=gen)
    q = torch.randn(num_tokens, 6, head_dim, generator=gen)
    k = torch.randn(num_tokens, 2, head_dim, generator=gen)
    cos, sin = hf(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = apply_rotary(q, k, positions, cache)
    assert torch.equal(q_out, q_hf[0].transpose(0, 1))
    assert torch.equal(k_out, k_hf[0].transpose(0, 1))


def test_rotary_rejects_unsupported_rope_types_and_missing_parameters() -> None:
    with pytest.raises(ValueError, match="dynamic"):
        compute_inv_freq(64, 10000.0, {"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        compute_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        compute_inv_freq(64, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        compute_inv_freq(64, 10000.0, {"rope_type": "default", "partial_rotary_factor": 0.5})


def test_silu_and_mul_matches_hf_mlp_with_fused_gate_up() -> None:
    gen = torch.Generator().manual_seed(8)
    config = LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu")
    mlp = LlamaMLP(config)  # type: ignore[no-untyped-call]
    x = torch.randn(5, 32, generator=gen)
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # gate first
    with torch.no_grad():
        ours = mlp.down_proj(silu_and_mul(x @ gate_up.T))
        torch.testing.assert_close(ours, mlp(x), atol=1e-6, rtol=0)
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        # Not bitwise: silu of a strided half may take torch's scalar tail path where HF's
        # contiguous gate is vectorized (last-ulp differences only).
        fused = silu_and_mul(torch.cat([gate, up], dim=-1))
        torch.testing.assert_close(fused, F.silu(gate) * up, atol=1e-7, rtol=1e-6)
        assert fused.shape == (5, 48)
