"""DeepSeek-V2/V3 (multi-head latent attention + DeepSeekMoE) on tiny random configs built
from transformers' own config classes, against HF in float32 on CPU.

Greedy tokens equal HF ``generate()`` (V3 with q_lora and grouped sigmoid routing, V2 without
q_lora and group-limited softmax routing, V2 with DeepSeek's YaRN; one batch, chunked
prefill on a 16-token budget, prefix-cache hits, preemption in a tiny cache); logprobs
within 1e-3; paged prefill across blocks and mixed decode rows over the latent cache within
1e-4; the router equals HF's router modules; the cache holds one latent per token (bytes
per block = the latent formula, K and V one tensor); TP=2 (gloo) equals TP=1.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checks import assert_llm_idle
from forward_inputs import Chunk, assert_logits_match, hf_logits, run_step, tokens_for
from parity import NEW_TOKENS, distinct_prompts, hf_greedy, shared_prefix_prompts
from tiny_deepseek import V2, V3, YARN, build_tiny_deepseek
from tp_ranks import GlooRanks, assert_ranks_identical, assert_same_run, run_rank
from transformers import AutoModelForCausalLM

from tokenwire.kernels.deepseek_routing import grouped_topk
from tokenwire.kernels.kv_quant import LayerKVCache
from tokenwire.runtime.config import CacheConfig, ModelConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.deepseek_checkpoint import rope_rows_half_split
from tokenwire.runtime.models.llama import LlamaForCausalLM
from tokenwire.runtime.models.moe import SparseMoeBlock
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder
from tokenwire.runtime.worker.kv_cache import KVCache, bytes_per_block

FAMILIES: dict[str, dict[str, Any]] = {
    "v3-q-lora-grouped-sigmoid": V3,
    "v2-no-q-lora-group-limited": V2,
    "v2-yarn-greedy": dict(V2, topk_method="greedy", rope_parameters=YARN),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {name: build_tiny_deepseek(root / name, f) for name, f in FAMILIES.items()}


@pytest.fixture(scope="module")
def v3(paths: dict[str, Path]) -> tuple[LoadedModel, Any]:
    path = paths["v3-q-lora-grouped-sigmoid"]
    ours = load_model(ModelConfig(model=str(path)), torch.device("cpu"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


def run_engine(path: Path, prompts: list[list[int]], **kwargs: Any) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device="cpu", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def latent_caches(model: LlamaForCausalLM, num_blocks: int = 32) -> list[LayerKVCache]:
    """The engine's MLA layout: one latent tensor per layer, as K and as V."""
    arch = model.arch
    shape = (num_blocks, 16, 1, arch.head_dim)
    caches = []
    for _ in range(arch.num_hidden_layers):
        latent = torch.zeros(shape)
        caches.append(LayerKVCache(latent, latent))
    return caches


# ----------------------------------------------------------------------------- config
def test_config_fields(v3: tuple[LoadedModel, Any], paths: dict[str, Path]) -> None:
    arch = v3[0].model.arch
    mla = arch.mla
    assert arch.architecture == "DeepseekV3ForCausalLM" and mla is not None
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim) == (48, 32, 8)
    assert mla.interleaved_rope and arch.rope_dim == 8
    assert arch.head_dim == 32 + 8 and arch.num_key_value_heads == 1 and arch.kv_cache_parts == 1
    assert arch.attention_scale == pytest.approx((16 + 8) ** -0.5)
    moe = arch.moe
    assert moe is not None and moe.deepseek is not None
    assert moe.sparse_layers == (False, True, True) and moe.renormalize
    assert moe.shared_expert_intermediate_size == 32 and not moe.shared_expert_gated
    assert moe.deepseek.sigmoid and moe.deepseek.correction_bias and moe.deepseek.group_top2_sum
    assert (moe.deepseek.num_groups, moe.deepseek.topk_groups) == (4, 2)
    yarn = load_model(
        ModelConfig(model=str(paths["v2-yarn-greedy"])), torch.device("cpu"), torch.float32
    ).arch
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert yarn.attention_scale == pytest.approx((16 + 8) ** -0.5 * mscale**2)
    assert yarn.mla is not None and yarn.mla.q_lora_rank is None
    assert yarn.moe is not None and yarn.moe.deepseek is not None
    assert yarn.moe.deepseek.num_groups == 1 and not yarn.moe.renormalize


# DeepSeek-V2-Lite's config.json (the keys this reads; shapes as released).
V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1,
    "norm_topk_prob": False, "scoring_func": "softmax", "topk_method": "greedy",
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "bos_token_id": 100000, "eos_token_id": 100001, "tie_word_embeddings": False,
}  # fmt: skip


def test_hub_config_keys() -> None:
    """A DeepSeek-V2-Lite style config.json (legacy ``rope_scaling`` with ``type``, null
    q_lora, ``scoring_func``) and the keys HF's maths does not implement."""
    arch = ModelArch.from_hf_config(V2_LITE)
    assert arch.mla is not None and arch.mla.q_lora_rank is None
    assert arch.head_dim == 576 and arch.rope_dim == 64 and arch.kv_cache_parts == 1
    assert (arch.rope_scaling_dict() or {})["rope_type"] == "yarn"
    mscale = 0.1 * 0.707 * math.log(40) + 1.0
    assert arch.attention_scale == pytest.approx(192**-0.5 * mscale**2)
    assert arch.moe is not None and arch.moe.sparse_layers == (False,) + (True,) * 26
    assert bytes_per_block(arch, 1, torch.bfloat16) == 27 * 576 * 2
    for key, value in (("scoring_func", "sigmoid"), ("moe_layer_freq", 2),
                       ("topk_method", "noaux"), ("attention_bias", True)):  # fmt: skip
        with pytest.raises(ValueError, match=key):
            ModelArch.from_hf_config({**V2_LITE, key: value})


def test_cache_holds_one_latent_per_token(v3: tuple[LoadedModel, Any]) -> None:
    """Bytes per block = layers x block x (kv_lora_rank + qk_rope_head_dim) x element size:
    no per-head K/V, no separate V; the allocated K and V caches are one tensor."""
    arch = v3[0].model.arch
    assert bytes_per_block(arch, 16, torch.float32) == 3 * 16 * (32 + 8) * 4
    assert bytes_per_block(arch, 16, torch.bfloat16, tp_size=2) == 3 * 16 * (32 + 8) * 2
    cache = KVCache.allocate(
        arch, CacheConfig(num_gpu_blocks_override=6), torch.device("cpu"), torch.float32
    )
    layer = cache.layers[0]
    assert layer.k_cache.shape == (6, 16, 1, 40)
    assert layer.k_cache.data_ptr() == layer.v_cache.data_ptr()


def test_startup_line_says_how_many_tokens_fit(
    paths: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's startup line: usable tokens and the latent formula's bytes per token
    (3 layers x (32 + 8) x 4 bytes)."""
    caplog.set_level(logging.INFO, logger="tokenwire.worker")
    path = str(paths["v3-q-lora-grouped-sigmoid"])
    llm = LLM(path, device="cpu", num_gpu_blocks_override=9, max_model_len=128)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert lines == [
        "KV cache: 8 blocks of 16 tokens, 128 tokens fit; 480 bytes per token "
        "(MLA latent: 32 + 8 per layer)"
    ]
    # What GetModelInfo's kv_bytes_per_token reports (the core's EngineInfo): the latent.
    assert llm.engine.facts.kv_bytes_per_token == 3 * (32 + 8) * 4
    assert_llm_idle(llm)


# ----------------------------------------------------------------------------- logits
def test_paged_prefill_and_mixed_batch_logits_match_hf(v3: tuple[LoadedModel, Any]) -> None:
    """A chunked prefill through non-contiguous blocks, then two decode rows and a fresh
    prefill in one step, all over the latent cache: every row within 1e-4 of HF's."""
    loaded, hf = v3
    model = loaded.model
    kv = latent_caches(model)
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


def test_correction_bias_moves_the_logits(v3: tuple[LoadedModel, Any]) -> None:
    """Parity is no accident: without V3's correction bias the routing (and logits) change."""
    loaded, hf = v3
    tokens = tokens_for(4, 30)
    copy = load_model(ModelConfig(model=str(loaded.model_path)), torch.device("cpu"), torch.float32)
    for layer in copy.model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.e_score_correction_bias is not None:
            layer.mlp.e_score_correction_bias.data.zero_()
    got = run_step(copy.model, latent_caches(copy.model), [Chunk(tokens, 0, [1, 2])])
    assert (got - hf_logits(hf, tokens)).abs().max() > 1e-2


# ----------------------------------------------------------------------------- routing
@pytest.mark.parametrize("version", ["v2-greedy", "v2-group-limited", "v3"])
def test_router_matches_hf(version: str) -> None:
    """``grouped_topk`` picks HF's experts with HF's weights (as sets per token)."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    gen = torch.Generator().manual_seed(0)
    common = dict(hidden_size=16, num_attention_heads=4, n_routed_experts=16,
                  num_experts_per_tok=4, n_group=4, topk_group=2,
                  routed_scaling_factor=1.7)  # fmt: skip
    router: Any
    if version == "v3":
        router = DeepseekV3TopkRouter(DeepseekV3Config(**common))
        router.e_score_correction_bias.normal_(0.0, 0.3, generator=gen)
    else:
        method = "greedy" if version == "v2-greedy" else "group_limited_greedy"
        router = DeepseekV2TopkRouter(DeepseekV2Config(**common, topk_method=method))
    router.weight.data.normal_(0.0, 1.0, generator=gen)
    x = torch.randn(64, 16, generator=gen)
    _, ref_w, ref_ids = router(x)
    v3 = version == "v3"
    weights, ids = grouped_topk(
        x @ router.weight.t(), 4, 1 if version == "v2-greedy" else 4, 2, sigmoid=v3,
        group_top2_sum=v3, renormalize=v3, routed_scaling_factor=1.7,
        correction_bias=router.e_score_correction_bias if v3 else None,
    )  # fmt: skip
    order, ref_order = ids.sort(dim=-1), ref_ids.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_w.gather(1, ref_order.indices))


def test_rope_rows_become_half_split() -> None:
    """Each block's last ``rope`` rows go from interleaved pairs to [0, 2, .., 1, 3, ..]."""
    rows = torch.arange(2 * 6, dtype=torch.float32).view(12, 1)
    out = rope_rows_half_split(rows, 2, 6, 4)[:, 0].tolist()
    assert out == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]


# ----------------------------------------------------------------------------- engine
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batch_matches_hf(family: str, paths: dict[str, Path]) -> None:
    prompts = distinct_prompts()
    expected = hf_greedy(paths[family], prompts)
    got, llm = run_engine(paths[family], prompts)
    assert got == expected
    assert len({tuple(t) for t in expected}) > 1  # not one degenerate continuation
    assert_llm_idle(llm)


def test_chunked_prefill_small_budget_matches_hf(paths: dict[str, Path]) -> None:
    path = paths["v3-q-lora-grouped-sigmoid"]
    prompts = distinct_prompts()
    got, llm = run_engine(path, prompts, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert got == hf_greedy(path, prompts)
    assert_llm_idle(llm)


def test_prefix_caching_shared_prefix_matches_hf(paths: dict[str, Path]) -> None:
    path = paths["v2-no-q-lora-group-limited"]
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


def test_tiny_kv_cache_preempts_and_matches_hf(paths: dict[str, Path]) -> None:
    """12 usable latent blocks of 16 tokens for 8 sequences growing to ~100 tokens: the
    scheduler preempts and recomputes, the tokens stay HF's."""
    path = paths["v3-q-lora-grouped-sigmoid"]
    prompts = distinct_prompts()
    recorder = StepRecorder()
    llm = LLM(str(path), device="cpu", observer=recorder, num_gpu_blocks_override=13,
              max_model_len=128)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(path, prompts)
    assert sum(s.num_preemptions for s in recorder.steps) > 0
    assert_llm_idle(llm)


def test_logprobs_close_to_hf(v3: tuple[LoadedModel, Any]) -> None:
    loaded, hf = v3
    prompt = distinct_prompts()[3]
    llm = LLM(str(loaded.model_path), device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ref = torch.log_softmax(hf_logits(hf, [*prompt, *out.token_ids]), dim=-1)
    for i, token in enumerate(out.token_ids):
        got = out.logprobs[i][token].logprob
        assert abs(got - float(ref[len(prompt) - 1 + i, token])) < 1e-3
    assert_llm_idle(llm)


# ----------------------------------------------------------------------------- TP
def test_tp2_gloo_ranks_match_tp1(paths: dict[str, Path]) -> None:
    """Heads split over 2 gloo ranks (latent projections and the latent cache replicated),
    expert and shared-expert widths split: equal to TP=1."""
    path = str(paths["v3-q-lora-grouped-sigmoid"])
    ref = run_rank(TPGroup.single(), path, "auto")
    pool = GlooRanks(2)
    try:
        results = pool.run(run_rank, path, "auto")
    finally:
        pool.close()
    assert_ranks_identical(results)
    assert_same_run(results[0], ref)
