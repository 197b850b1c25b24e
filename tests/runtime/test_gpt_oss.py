"""gpt-oss (``GptOssForCausalLM``) on the CPU float32 torch path, against HF transformers.

The tiny config has 3 layers (sliding, full, sliding: HF's default alternation) with an
8-token window far shorter than the prompts plus generation, 4 experts routed top-2, a
swiglu_limit low enough to clamp, YaRN rope and random attention sinks. Checked: the config
keys as HF reads them; logits of a chunked paged prefill and a mixed decode + prefill batch
within 1e-4 of HF's; each gpt-oss feature (sinks, window, clamp, routing, YaRN) shown to
matter; greedy tokens equal to HF's ``generate()`` for one prompt, a batch of different
lengths, a small chunked-prefill budget and prefix-cache hits; logprobs within 1e-3; the
paged attention torch path with sinks against its dense oracle; YaRN's frequencies and
attention factor bit-equal to HF's; TP=2 on gloo ranks equal to TP=1. MXFP4 checkpoints:
``test_gpt_oss_mxfp4.py``.
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
from tokenwire.kernels.rotary import compute_inv_freq, rope_attention_scaling
from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.gpt_oss_checkpoint import split_gpt_oss_experts
from tokenwire.runtime.models.moe import SparseMoeBlock
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder

WINDOW = 8
YARN: dict[str, Any] = {
    "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0,
}  # fmt: skip
GPT_OSS: dict[str, Any] = dict(
    model_type="gpt_oss", hidden_size=64, intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, swiglu_limit=3.0,
    rope_parameters=YARN,
)  # fmt: skip


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("gpt-oss"), **GPT_OSS)


@pytest.fixture(scope="module")
def models(path: Path) -> tuple[LoadedModel, Any]:
    ours = load_model(ModelConfig(model=str(path)), torch.device("cpu"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


@pytest.fixture(scope="module")
def expected(path: Path) -> list[list[int]]:
    return hf_greedy(path, distinct_prompts())


def run_engine(
    path: Path, prompts: list[list[int]], **kwargs: Any
) -> tuple[list[list[int]], LLM, StepRecorder]:
    recorder = StepRecorder()
    llm = LLM(str(path), device="cpu", observer=recorder, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm, recorder


# ----------------------------------------------------------------------------- config keys
def test_config_fields(models: tuple[LoadedModel, Any]) -> None:
    arch = models[0].model.arch
    assert arch.architecture == "GptOssForCausalLM" and arch.attention_sinks
    assert arch.layer_sliding_window == (WINDOW, None, WINDOW)
    assert arch.attention_bias and arch.o_proj_bias
    scaling = arch.rope_scaling_dict()
    assert scaling is not None and scaling["rope_type"] == "yarn" and scaling["factor"] == 4.0
    moe = arch.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (4, 2, 32)
    assert moe.router_bias and moe.expert_bias and moe.softmax_after_topk
    assert moe.swiglu == (1.702, 3.0) and all(moe.sparse_layers)


def test_hub_defaults() -> None:
    """A config.json with only the shape keys: HF's defaults (alternating layers from a
    sliding first layer, attention biases, YaRN factor from the positions)."""
    cfg = {
        "architectures": ["GptOssForCausalLM"], "hidden_size": 64, "intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 4096,
        "sliding_window": 128, "num_local_experts": 8,
        "rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 1024,
                            "rope_theta": 150000.0},
    }  # fmt: skip
    arch = ModelArch.from_hf_config(cfg)
    assert arch.layer_sliding_window == (128, None, 128, None)
    assert arch.attention_bias and arch.o_proj_bias and arch.attention_sinks
    assert arch.moe is not None and arch.moe.top_k == 4 and arch.moe.swiglu == (1.702, 7.0)
    assert (arch.rope_scaling_dict() or {})["factor"] == 4.0
    arch.check_tensor_parallel(2)


# ----------------------------------------------------------------------------- logits
def test_paged_prefill_and_mixed_batch_logits_match_hf(models: tuple[LoadedModel, Any]) -> None:
    """A chunked prefill through non-contiguous blocks past the window, then two decode rows
    and a fresh prefill in one step: every row's logits within 1e-4 of HF's."""
    loaded, hf = models
    model = loaded.model
    kv = new_kv_caches(model)
    tokens = tokens_for(1, 37)
    first = run_step(model, kv, [Chunk(tokens[:16], 0, [9, 3, 14])])
    second = run_step(model, kv, [Chunk(tokens[16:], 16, [9, 3, 14])])
    assert_logits_match(torch.cat([first, second]), hf_logits(hf, tokens))
    other = tokens_for(2, 10)
    run_step(model, kv, [Chunk(other, 0, [4])])
    fresh = tokens_for(3, 20)
    step = [Chunk([7], 37, [9, 3, 14]), Chunk([8], 10, [4]), Chunk(fresh, 0, [17, 2])]
    logits = run_step(model, kv, step)
    assert_logits_match(logits[0:1], hf_logits(hf, [*tokens, 7])[-1:])
    assert_logits_match(logits[1:2], hf_logits(hf, [*other, 8])[-1:])
    assert_logits_match(logits[2:], hf_logits(hf, fresh))


def _no_sinks(model: Any) -> None:
    for layer in model.model.layers:
        layer.self_attn.sinks = None


def _no_window(model: Any) -> None:
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None


def _no_clamp(model: Any) -> None:
    for layer in model.model.layers:
        assert layer.mlp.experts.swiglu is not None
        layer.mlp.experts.swiglu = (layer.mlp.experts.swiglu[0], 1e9)


def _softmax_before_topk(model: Any) -> None:
    for layer in model.model.layers:
        assert isinstance(layer.mlp, SparseMoeBlock)
        layer.mlp.softmax_after_topk = False
        layer.mlp.renormalize = False  # else softmax-then-top-k renormalised is the same


def _plain_rope(model: Any) -> None:
    from tokenwire.runtime.models.llama import rope_cache

    arch = model.arch
    model.cos_sin_cache = rope_cache(arch, arch.rope_theta, None, model.max_position, torch.float32)


ABLATIONS: dict[str, Callable[[Any], None]] = {
    "sinks": _no_sinks,
    "window": _no_window,
    "swiglu-clamp": _no_clamp,
    "yarn": _plain_rope,
}


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_each_feature_moves_the_logits(name: str, models: tuple[LoadedModel, Any]) -> None:
    """Parity is no accident: dropping any one gpt-oss feature moves the logits far past the
    parity tolerance (routing: softmax-then-top-k differs only without renormalisation)."""
    ours, hf = models
    tokens = tokens_for(4, 30)
    ref = hf_logits(hf, tokens)
    copy = load_model(ModelConfig(model=str(ours.model_path)), torch.device("cpu"), torch.float32)
    ABLATIONS[name](copy.model)
    got = run_step(copy.model, new_kv_caches(copy.model), [Chunk(tokens, 0, [1, 2])])
    assert (got - ref).abs().max() > 1e-2


def test_routing_softmax_of_the_top_k(models: tuple[LoadedModel, Any]) -> None:
    ours, hf = models
    tokens = tokens_for(5, 30)
    copy = load_model(ModelConfig(model=str(ours.model_path)), torch.device("cpu"), torch.float32)
    _softmax_before_topk(copy.model)
    got = run_step(copy.model, new_kv_caches(copy.model), [Chunk(tokens, 0, [1, 2])])
    assert (got - hf_logits(hf, tokens)).abs().max() > 1e-2


# ----------------------------------------------------------------------------- engine
def test_single_prompt_matches_hf(path: Path, expected: list[list[int]]) -> None:
    prompt = distinct_prompts()[5]
    got, llm, _ = run_engine(path, [prompt])
    assert got == [expected[5]]
    assert len(prompt) + NEW_TOKENS > 4 * WINDOW  # the window matters
    assert_llm_idle(llm)


def test_batch_matches_hf(path: Path, expected: list[list[int]]) -> None:
    got, llm, recorder = run_engine(path, distinct_prompts())
    assert got == expected
    assert max(s.num_seqs for s in recorder.steps) == 8
    assert len({tuple(t) for t in expected}) > 1  # not one degenerate continuation
    assert_llm_idle(llm)


def test_chunked_prefill_small_budget_matches_hf(path: Path, expected: list[list[int]]) -> None:
    got, llm, recorder = run_engine(
        path, distinct_prompts(), max_num_batched_tokens=16, enable_prefix_caching=False
    )
    assert got == expected
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= 16 for s in recorder.steps)
    assert any(s.phase == "mixed" for s in recorder.steps)
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
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    tokens = [*prompt, *out.token_ids]
    ref = torch.log_softmax(hf_logits(models[1], tokens), dim=-1)
    for i, token in enumerate(out.token_ids):
        got = out.logprobs[i][token].logprob
        assert abs(got - float(ref[len(prompt) - 1 + i, token])) < 1e-3
    assert_llm_idle(llm)


# ----------------------------------------------------------------------------- loading
def test_expert_tensors_split_per_expert() -> None:
    """HF's interleaved gate/up columns land as gate rows then up rows, transposed."""
    gate_up = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)  # [E, H, 2I]
    split = dict(split_gpt_oss_experts([("model.layers.0.mlp.experts.gate_up_proj", gate_up)]))
    gate = split["model.layers.0.mlp.experts.1.gate_proj.weight"]
    up = split["model.layers.0.mlp.experts.1.up_proj.weight"]
    assert torch.equal(gate, gate_up[1][:, ::2].t()) and torch.equal(up, gate_up[1][:, 1::2].t())
    router = dict(split_gpt_oss_experts([("model.layers.2.mlp.router.bias", torch.zeros(4))]))
    assert list(router) == ["model.layers.2.mlp.gate.bias"]


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_sinks_match_the_dense_oracle(window: int | None) -> None:
    """The batched torch path with sinks (GQA folded) equals the per-position oracle, for
    decode rows and chunked prefill rows, with and without a window."""
    gen = torch.Generator().manual_seed(0)
    chunks = [Chunk([1], 20, [3, 5]), Chunk([1] * 7, 9, [4, 6]), Chunk([1] * 12, 0, [7])]
    meta = make_meta(chunks)
    k_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=gen)
    v_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=gen)
    query = torch.randn(meta.num_tokens, 6, 16, generator=gen)
    sinks = torch.randn(6, generator=gen) * 2
    args = (k_cache, v_cache, meta, 0.25)
    got = paged_attention_ref(query, query, query, *args, sliding_window=window, sinks=sinks)
    ref = paged_attention_dense_ref(query, *args, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    plain = paged_attention_dense_ref(query, *args, sliding_window=window)
    assert (plain - ref).abs().max() > 1e-2


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_matches_hf(truncate: bool) -> None:
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**YARN, "truncate": truncate}
    config = GptOssConfig(
        head_dim=16, hidden_size=64, num_attention_heads=4, rope_parameters=dict(params)
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    assert torch.equal(compute_inv_freq(16, YARN["rope_theta"], params), inv_freq)
    assert rope_attention_scaling(params) == factor


# ----------------------------------------------------------------------------- TP
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_tp2_gloo_ranks_match_tp1(load_format: str, path: Path) -> None:
    """Heads (each rank reads its own sinks), expert widths and the gate/up biases split over
    2 gloo ranks, the down bias added once; loaded and seeded dummy weights equal TP=1."""
    ref = run_rank(TPGroup.single(), str(path), load_format)
    pool = GlooRanks(2)
    try:
        results = pool.run(run_rank, str(path), load_format)
    finally:
        pool.close()
    assert_ranks_identical(results)
    assert_same_run(results[0], ref)
