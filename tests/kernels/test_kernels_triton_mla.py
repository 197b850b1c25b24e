"""DeepSeek's MLA and DeepSeekMoE through the Triton kernels (the CUDA path), under the CPU
interpreter: decode rows through the MLA decode kernel over the latent cache, prefill rows
through the generic paged prefill kernel (one MQA head of ``kv_lora_rank + qk_rope_head_dim``
features, values = keys), and a tiny DeepSeek-V3's forward with every kernel in Triton equals
the torch path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from forward_inputs import Chunk, run_step, tokens_for
from kernel_inputs import ON_CUDA
from tiny_deepseek import V3, build_tiny_deepseek

from tokenwire.kernels import mla_decode_triton
from tokenwire.kernels.kv_quant import LayerKVCache
from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.loader.model_loader import load_model


@pytest.mark.skipif(ON_CUDA, reason="compares the interpreter with the CPU torch path")
def test_deepseek_v3_forward_in_triton_equals_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunked prefill across blocks, then a decode and a fresh prefill in one step, every
    kernel (paged attention over the latent cache, grouped-routed MoE, rotary, norms) in
    Triton: equal to the torch path's logits within 1e-4."""
    path = build_tiny_deepseek(tmp_path, V3)
    model = load_model(ModelConfig(model=str(path)), torch.device("cpu"), torch.float32).model
    tokens, fresh = tokens_for(1, 29), tokens_for(2, 11)
    steps = [
        [Chunk(tokens[:13], 0, [9, 3])],
        [Chunk(tokens[13:], 13, [9, 3])],
        [Chunk([7], 29, [9, 3]), Chunk(fresh, 0, [5])],
    ]

    def run() -> torch.Tensor:
        kv = []
        for _ in range(model.arch.num_hidden_layers):
            latent = torch.zeros(16, 16, 1, model.arch.head_dim)
            kv.append(LayerKVCache(latent, latent))
        return torch.cat([run_step(model, kv, chunks) for chunks in steps])

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ref = run()
    calls: list[tuple[str, int]] = []
    for module, name in (
        (mla_decode_triton, "mla_decode_attention"),
        (mla_decode_triton, "prefill_attention"),
    ):
        monkeypatch.setattr(module, name, _counted(getattr(module, name), name, calls))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = run()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # Both kernels ran over the latent cache (32 + 8 features per token).
    assert set(calls) == {("mla_decode_attention", 32 + 8), ("prefill_attention", 32 + 8)}


def _counted(fn: Any, name: str, calls: list[tuple[str, int]]) -> Any:
    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append((name, args[1].shape[-1]))
        fn(*args, **kwargs)

    return counted
