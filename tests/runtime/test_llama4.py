"""Llama 4 text (``Llama4ForCausalLM``) on the CPU float32 torch path, against HF transformers.

Tiny config, 4 layers: chunked-rope MoE, NoPE dense, chunked-rope dense, NoPE MoE; an 8-token
attention chunk (prompts + generation cross many), 4 experts top-1 + a shared expert, q/k L2
norm, attention temperature with a small ``floor_scale``, llama3 rope. Checked: config keys;
paged chunked-prefill and mixed-batch logits within 1e-4; each feature matters; engine greedy
tokens equal HF ``generate()`` (one prompt, a batch, a 16-token budget, prefix-cache hits, the
multimodal wrapper's checkpoint); logprobs within 1e-3; chunked paged attention vs its dense
oracle; checkpoint mapping; TP=2 (gloo) equals TP=1. Triton: tests/kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checks import assert_llm_idle
from forward_inputs import (
    BLOCK_SIZE,
    Chunk,
    assert_logits_match,
    hf_logits,
    make_meta,
    new_kv_caches,
    run_step,
    tokens_for,
)
from parity import NEW_TOKENS, distinct_prompts, hf_greedy, shared_prefix_prompts
from tiny_models import build_tiny_model
from tp_ranks import GlooRanks, assert_ranks_identical, assert_same_run, run_rank
from transformers import AutoModelForCausalLM

from tokenwire.kernels.paged_attention import paged_attention_dense_ref, paged_attention_ref
from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.llama4_checkpoint import llama4_tensors
from tokenwire.runtime.models.moe import SparseMoeBlock
from tokenwire.runtime.sampling_params import SamplingParams

CHUNK = 8
LLAMA3: dict[str, Any] = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}  # fmt: skip
LLAMA4: dict[str, Any] = dict(
    model_type="llama4_text", hidden_size=64, intermediate_size=32, intermediate_size_mlp=48,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=512, num_local_experts=4, num_experts_per_tok=1,
    moe_layers=[0, 3], no_rope_layer_interval=2, attention_chunk_size=CHUNK, floor_scale=4,
    attn_scale=0.5, rope_parameters=LLAMA3, rope_theta=None,
)  # fmt: skip


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama4"), **LLAMA4)


@pytest.fixture(scope="module")
def models(path: Path) -> tuple[LoadedModel, Any]:
    ours = load_model(ModelConfig(model=str(path)), torch.device("cpu"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


@pytest.fixture(scope="module")
def expected(path: Path) -> list[list[int]]:
    return hf_greedy(path, distinct_prompts())


def run_engine(path: Path, prompts: list[list[int]], **kwargs: Any) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device="cpu", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


# ----------------------------------------------------------------------------- config keys
def test_config_fields(models: tuple[LoadedModel, Any]) -> None:
    arch = models[0].model.arch
    assert arch.architecture == "Llama4ForCausalLM"
    assert arch.layer_attention_chunk == (CHUNK, None, CHUNK, None)
    assert arch.layer_rope == (True, False, True, False)
    assert arch.qk_l2_norm and arch.attn_temperature == (4.0, 0.5)
    assert arch.intermediate_size == 48 and arch.interleaved_rope_checkpoint
    assert arch.layer_window(0) is None and arch.sliding_window is None
    assert (arch.rope_scaling_dict() or {})["rope_type"] == "llama3"
    moe = arch.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (4, 1, 32)
    assert moe.sparse_layers == (True, False, False, True)
    assert moe.sigmoid_input_scaling and not moe.shared_expert_gated
    assert moe.shared_expert_intermediate_size == 32


def test_hub_defaults_and_multimodal_wrapper() -> None:
    """Only the shape keys: HF's defaults (every 4th layer NoPE, the others chunked at 8192,
    every layer MoE, theta 500000); a ``Llama4ForConditionalGeneration`` config.json serves its
    ``text_config``."""
    text = {
        "hidden_size": 64, "intermediate_size": 32, "intermediate_size_mlp": 48,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 4096,
    }  # fmt: skip
    arch = ModelArch.from_hf_config({"architectures": ["Llama4ForCausalLM"], **text})
    assert arch.layer_attention_chunk == (8192, 8192, 8192, None)
    assert arch.layer_rope == (True, True, True, False) and arch.rope_theta == 500000.0
    assert arch.moe is not None and arch.moe.sparse_layers == (True,) * 4
    assert arch.moe.num_experts == 16 and arch.moe.top_k == 1
    wrapped = {"architectures": ["Llama4ForConditionalGeneration"], "text_config": text}
    outer = ModelArch.from_hf_config(wrapped)
    assert outer.architecture == "Llama4ForConditionalGeneration"
    assert outer.layer_attention_chunk == arch.layer_attention_chunk
    arch.check_tensor_parallel(2)
    with pytest.raises(ValueError, match="intermediate_size_mlp"):
        ModelArch.from_hf_config({**text, "architectures": ["Llama4ForCausalLM"],
                                  "intermediate_size_mlp": 45, "moe_layers": [1]}
                                 ).check_tensor_parallel(2)  # fmt: skip


# ----------------------------------------------------------------------------- logits
def test_paged_prefill_and_mixed_batch_logits_match_hf(models: tuple[LoadedModel, Any]) -> None:
    """A chunked prefill through non-contiguous blocks over several attention chunks, then
    two decode rows and a fresh prefill in one step: every row within 1e-4 of HF's."""
    loaded, hf = models
    model = loaded.model
    kv = new_kv_caches(model)
    tokens = tokens_for(1, 37)
    first = run_step(model, kv, [Chunk(tokens[:13], 0, [9, 3, 14])])
    second = run_step(model, kv, [Chunk(tokens[13:], 13, [9, 3, 14])])
    assert_logits_match(torch.cat([first, second]), hf_logits(hf, tokens))
    other = tokens_for(2, 10)
    run_step(model, kv, [Chunk(other, 0, [4])])
    fresh = tokens_for(3, 20)
    step = [Chunk([7], 37, [9, 3, 14]), Chunk([8], 10, [4]), Chunk(fresh, 0, [17, 2])]
    logits = run_step(model, kv, step)
    assert_logits_match(logits[0:1], hf_logits(hf, [*tokens, 7])[-1:])
    assert_logits_match(logits[1:2], hf_logits(hf, [*other, 8])[-1:])
    assert_logits_match(logits[2:], hf_logits(hf, fresh))


def _set_attention(name: str, value: Any) -> Callable[[Any], None]:
    def ablate(model: Any) -> None:
        for layer in model.model.layers:
            setattr(layer.self_attn, name, value)

    return ablate


def _output_scaled_experts(model: Any) -> None:
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.experts.scale_input = False


ABLATIONS: dict[str, Callable[[Any], None]] = {
    "chunked-attention": _set_attention("attention_chunk", None),
    "nope-layers": _set_attention("use_rope", True),
    "qk-l2-norm": _set_attention("l2_norm_eps", None),
    "temperature": _set_attention("temperature", None),
    "input-scaled-experts": _output_scaled_experts,
}


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_each_feature_moves_the_logits(name: str, models: tuple[LoadedModel, Any]) -> None:
    """Parity is no accident: dropping any one Llama 4 feature moves the logits."""
    ours, hf = models
    tokens = tokens_for(4, 30)
    ref = hf_logits(hf, tokens)
    copy = load_model(ModelConfig(model=str(ours.model_path)), torch.device("cpu"), torch.float32)
    ABLATIONS[name](copy.model)
    got = run_step(copy.model, new_kv_caches(copy.model), [Chunk(tokens, 0, [1, 2])])
    assert (got - ref).abs().max() > 1e-2


# ----------------------------------------------------------------------------- engine
def test_single_prompt_matches_hf(path: Path, expected: list[list[int]]) -> None:
    prompt = distinct_prompts()[5]
    got, llm = run_engine(path, [prompt])
    assert got == [expected[5]]
    assert len(prompt) + NEW_TOKENS > 8 * CHUNK  # many chunk boundaries
    assert_llm_idle(llm)


def test_batch_matches_hf(path: Path, expected: list[list[int]]) -> None:
    got, llm = run_engine(path, distinct_prompts())
    assert got == expected
    assert len({tuple(t) for t in expected}) > 1  # not one degenerate continuation
    assert_llm_idle(llm)


def test_chunked_prefill_small_budget_matches_hf(path: Path, expected: list[list[int]]) -> None:
    got, llm = run_engine(
        path, distinct_prompts(), max_num_batched_tokens=16, enable_prefix_caching=False
    )
    assert got == expected
    assert_llm_idle(llm)


def test_prefix_caching_shared_prefix_matches_hf(path: Path) -> None:
    prompts = shared_prefix_prompts()
    reference = hf_greedy(path, prompts)
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == reference
    assert [o.outputs[0].token_ids for o in second] == reference
    assert all(o.num_cached_tokens >= 32 for o in second)
    assert_llm_idle(llm)


def test_logprobs_close_to_hf(path: Path, models: tuple[LoadedModel, Any]) -> None:
    prompt = distinct_prompts()[3]
    llm = LLM(str(path), device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    tokens = [*prompt, *out.token_ids]
    ref = torch.log_softmax(hf_logits(models[1], tokens), dim=-1)
    for i, token in enumerate(out.token_ids):
        got = out.logprobs[i][token].logprob
        assert abs(got - float(ref[len(prompt) - 1 + i, token])) < 1e-3
    assert_llm_idle(llm)


# ----------------------------------------------------------------------------- loading
def test_checkpoint_mapping(models: tuple[LoadedModel, Any]) -> None:
    """Interleaved q/k rows become half-split per head; fused experts split per expert (gate
    columns first); the router becomes ``mlp.gate``; vision tensors are skipped and the
    ``language_model.`` prefix dropped."""
    arch = models[0].model.arch
    q = torch.arange(4 * 16, dtype=torch.float32).view(64, 1).expand(64, 2)
    gate_up = torch.randn(4, 64, 64)
    weights = [
        ("language_model.model.layers.0.self_attn.q_proj.weight", q),
        ("language_model.model.layers.0.feed_forward.experts.gate_up_proj", gate_up),
        ("language_model.model.layers.0.feed_forward.router.weight", torch.zeros(4, 64)),
        ("vision_model.patch_embedding.linear.weight", torch.zeros(1)),
        ("multi_modal_projector.linear_1.weight", torch.zeros(1)),
    ]
    out = dict(llama4_tensors(weights, arch))
    rows = out["model.layers.0.self_attn.q_proj.weight"][:16, 0].tolist()
    assert rows == [*range(0, 16, 2), *range(1, 16, 2)]
    assert torch.equal(out["model.layers.0.mlp.experts.2.gate_proj.weight"], gate_up[2, :, :32].t())
    assert torch.equal(out["model.layers.0.mlp.experts.2.up_proj.weight"], gate_up[2, :, 32:].t())
    assert "model.layers.0.mlp.gate.weight" in out
    assert not any(k.startswith(("vision", "multi_modal")) for k in out)


def _multimodal_checkpoint(out_dir: Path) -> Path:
    """A tiny random ``Llama4ForConditionalGeneration`` (2 text layers, 1 vision layer)."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    text = {k: v for k, v in LLAMA4.items() if k not in ("model_type", "rope_theta")}
    text.update(num_hidden_layers=2, moe_layers=[1], vocab_size=512, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)  # fmt: skip
    vision = dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        vision_output_dim=32, projector_input_dim=32, projector_output_dim=32, image_size=28,
        patch_size=14,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 0.05)
            if name.endswith("norm.weight"):
                p.add_(1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def test_multimodal_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """A ``Llama4ForConditionalGeneration`` checkpoint: the engine serves its language model
    (vision tensors skipped) with HF's (that class's own) greedy tokens for text prompts."""
    from transformers import Llama4ForConditionalGeneration

    path = _multimodal_checkpoint(tmp_path)
    prompts = distinct_prompts()[2:5]
    got, llm = run_engine(path, prompts)
    hf = Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, got, strict=True):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert tokens == out[0, len(prompt) :].tolist()
    assert_llm_idle(llm)


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("chunk", [4, 8])
def test_chunked_paged_attention_matches_the_dense_oracle(chunk: int) -> None:
    """The torch path with chunked attention equals the per-position oracle (decode and
    chunked prefill rows; chunks smaller than and equal to a block)."""
    gen = torch.Generator().manual_seed(0)
    chunks = [Chunk([1], 20, [3, 5]), Chunk([1] * 7, 9, [4, 6]), Chunk([1] * 12, 0, [7])]
    meta = make_meta(chunks)
    k_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=gen)
    v_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=gen)
    query = torch.randn(meta.num_tokens, 6, 16, generator=gen)
    args = (k_cache, v_cache, meta, 0.25)
    got = paged_attention_ref(query, query, query, *args, attention_chunk=chunk)
    ref = paged_attention_dense_ref(query, *args, attention_chunk=chunk)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert (paged_attention_dense_ref(query, *args) - ref).abs().max() > 1e-2


# ----------------------------------------------------------------------------- TP
def test_tp2_gloo_ranks_match_tp1(path: Path) -> None:
    """Heads, expert and shared-expert widths and the dense MLP split over 2 gloo ranks
    (each rank permutes its own q/k rows): equal to TP=1."""
    ref = run_rank(TPGroup.single(), str(path), "auto")
    pool = GlooRanks(2)
    try:
        results = pool.run(run_rank, str(path), "auto")
    finally:
        pool.close()
    assert_ranks_identical(results)
    assert_same_run(results[0], ref)
