"""Mixtral, Qwen2-MoE and Qwen3-MoE: config keys read as HF reads them, HF parity (greedy tokens
through the engine; logits of a fresh prefill, a chunked prefill and a mixed decode + prefill
batch through the paged cache), each routing feature shown to matter, checkpoint names mapped
into the stacked experts, clear refusals (quantization, LoRA, impossible splits), and TP=2 on
gloo ranks equal to TP=1 (loaded and dummy weights).

The tiny configs route top-2 of 4 (Mixtral, always renormalised), top-2 of 6 with a shared
expert and a dense layer from ``mlp_only_layers`` (Qwen2-MoE, softmax weights kept) and top-3
of 8 with ``norm_topk_prob`` and ``decoder_sparse_step=2`` (Qwen3-MoE: layer 0 dense).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from forward_inputs import (
    Chunk,
    assert_logits_match,
    hf_logits,
    new_kv_caches,
    run_step,
    tokens_for,
)
from tiny_models import build_tiny_model
from tp_ranks import GlooRanks, assert_ranks_identical, assert_same_run, run_rank
from transformers import AutoModelForCausalLM

from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.bundled_configs import bundled_config_path
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.decoder import MLP
from tokenwire.runtime.models.llama import build_model
from tokenwire.runtime.models.moe import SparseMoeBlock
from tokenwire.runtime.sampling_params import SamplingParams

# Overrides of conftest's tiny Llama (hidden 64, 4 heads / 2 KV heads, 512 positions).
MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": dict(
        model_type="mixtral", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        rope_theta=1e6,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe", num_hidden_layers=3, intermediate_size=96, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", intermediate_size=96, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2, head_dim=32,
    ),
}  # fmt: skip
FAMILIES = sorted(MOE_FAMILIES)
NEW_TOKENS = 16


def build_tiny_moe(family: str, out: Path, **overrides: Any) -> Path:
    return build_tiny_model("llama", out, **{**MOE_FAMILIES[family], **overrides})


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = build_tiny_moe(family, tmp_path_factory.mktemp(f"moe-{family}"))
        return cache[family]

    return get


@pytest.fixture(scope="module")
def models(paths: Callable[[str], Path]) -> Callable[[str], tuple[LoadedModel, Any]]:
    cache: dict[str, tuple[LoadedModel, Any]] = {}

    def get(family: str) -> tuple[LoadedModel, Any]:
        if family not in cache:
            path = paths(family)
            ours = load_model(ModelConfig(model=str(path)), torch.device("cpu"), torch.float32)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[family] = (ours, hf)
        return cache[family]

    return get


# ----------------------------------------------------------------------------- config keys
def test_mixtral_bundled_config_fields() -> None:
    path = bundled_config_path("mixtral-8x7b")
    assert path is not None
    arch = ModelArch.from_hf_config(json.loads(path.read_text()))
    assert arch.moe is not None
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.intermediate_size) == (8, 2, 14336)
    assert arch.moe.renormalize and not arch.moe.has_shared_expert
    assert all(arch.moe.sparse_layers) and len(arch.moe.sparse_layers) == 32
    assert not arch.attention_bias and arch.sliding_window is None
    arch.check_tensor_parallel(8)


# Qwen/Qwen1.5-MoE-A2.7B's MoE keys (no qkv_bias key: HF's default, q/k/v biases).
QWEN15_MOE: dict[str, Any] = {
    "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
    "vocab_size": 151936, "max_position_embeddings": 8192, "rope_theta": 1000000.0,
    "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
    "norm_topk_prob": False, "use_sliding_window": False, "sliding_window": 32768,
    "max_window_layers": 21, "tie_word_embeddings": False,
}  # fmt: skip


def test_qwen2_moe_hub_config_fields() -> None:
    arch = ModelArch.from_hf_config(QWEN15_MOE)
    assert arch.moe is not None
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.intermediate_size) == (60, 4, 1408)
    assert arch.moe.shared_expert_intermediate_size == 5632 and not arch.moe.renormalize
    assert arch.attention_bias and not arch.o_proj_bias and arch.sliding_window is None
    dense = ModelArch.from_hf_config({**QWEN15_MOE, "mlp_only_layers": [0, 23]})
    assert dense.layer_is_sparse(1) and not dense.layer_is_sparse(0)
    assert not dense.layer_is_sparse(23)
    step = ModelArch.from_hf_config({**QWEN15_MOE, "decoder_sparse_step": 3})
    assert [step.layer_is_sparse(i) for i in range(6)] == [False, False, True] * 2
    assert ModelArch.from_hf_config({**QWEN15_MOE, "num_experts": 0}).moe is None


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_experts_per_tok": 61}, "num_experts_per_tok"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"mlp_only_layers": [24]}, "mlp_only_layers"),
        ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_unsupported_moe_values_name_the_key(change: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ModelArch.from_hf_config({**QWEN15_MOE, **change})


def test_tp_split_of_expert_width_names_the_key() -> None:
    arch = ModelArch.from_hf_config({**QWEN15_MOE, "moe_intermediate_size": 1410})
    with pytest.raises(ValueError, match=r"tensor-parallel-size=4.*moe_intermediate_size"):
        arch.check_tensor_parallel(4)
    arch.check_tensor_parallel(2)


# ----------------------------------------------------------------------------- HF parity
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_hf_generate(
    family: str, models: Callable[[str], tuple[LoadedModel, Any]]
) -> None:
    """Three prompts batched through the engine (prefill, then decode steps of 3 rows)."""
    ours, hf = models(family)
    prompts = [tokens_for(30 + i, n) for i, n in enumerate((5, 23, 41))]
    want = [_hf_generate(hf, p, NEW_TOKENS) for p in prompts]
    llm = LLM(str(ours.model_path), device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


@torch.inference_mode()
def _hf_generate(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return list(ids[0, len(prompt) :].tolist())


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_prefill_and_mixed_batch_logits_match_hf(
    family: str, models: Callable[[str], tuple[LoadedModel, Any]]
) -> None:
    """A chunked prefill through non-contiguous blocks, then a batch of two decode rows and a
    fresh prefill: every row's logits within 1e-4 of HF's."""
    loaded, hf = models(family)
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


def test_layer_kinds_follow_the_config(models: Callable[[str], tuple[LoadedModel, Any]]) -> None:
    kinds = {
        family: [type(layer.mlp) for layer in models(family)[0].model.model.layers]
        for family in FAMILIES
    }
    assert kinds["mixtral"] == [SparseMoeBlock, SparseMoeBlock]
    assert kinds["qwen2_moe"] == [SparseMoeBlock, MLP, SparseMoeBlock]
    assert kinds["qwen3_moe"] == [MLP, SparseMoeBlock]
    qwen2 = models("qwen2_moe")[0].model.model.layers[0].mlp
    assert qwen2.shared_expert is not None and qwen2.experts.w13_weight.shape == (6, 64, 64)


def _no_renormalize(model: Any) -> None:
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.renormalize = not layer.mlp.renormalize


def _top_1(model: Any) -> None:
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.top_k = 1


def _no_shared_expert(model: Any) -> None:
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.shared_expert = None


ABLATIONS: dict[str, tuple[str, Callable[[Any], None]]] = {
    "mixtral-renormalize": ("mixtral", _no_renormalize),
    "mixtral-top-2": ("mixtral", _top_1),
    "qwen2-shared-expert": ("qwen2_moe", _no_shared_expert),
    "qwen2-softmax-weights": ("qwen2_moe", _no_renormalize),
    "qwen3-norm-topk-prob": ("qwen3_moe", _no_renormalize),
}


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_each_routing_feature_moves_the_logits(
    name: str, models: Callable[[str], tuple[LoadedModel, Any]]
) -> None:
    """Parity is no accident: flipping the renormalisation rule, routing to one expert or
    dropping the shared expert moves the logits far past the 1e-4 parity tolerance."""
    family, ablate = ABLATIONS[name]
    ours, hf = models(family)
    tokens = tokens_for(4, 30)
    ref = hf_logits(hf, tokens)
    copy = load_model(ModelConfig(model=str(ours.model_path)), torch.device("cpu"), torch.float32)
    ablate(copy.model)
    got = run_step(copy.model, new_kv_caches(copy.model), [Chunk(tokens, 0, [1, 2])])
    assert (got - ref).abs().max() > 1e-2


# ----------------------------------------------------------------------------- loading
def test_missing_expert_tensor_is_named(paths: Callable[[str], Path]) -> None:
    from safetensors.torch import load_file

    path = paths("mixtral")
    weights = load_file(str(path / "model.safetensors"))
    missing = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    assert missing in weights
    arch = ModelArch.from_hf_config(json.loads((path / "config.json").read_text()))
    model = build_model(arch, torch.device("cpu"), torch.float32, 64)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj.*w3"):
        model.load_weights((n, w) for n, w in weights.items() if n != missing)
    with pytest.raises(ValueError, match=r"shape mismatch for model\.layers\.0\.block_sparse_moe"):
        bad = dict(weights)
        bad["model.layers.0.block_sparse_moe.experts.0.w2.weight"] = torch.zeros(64, 47)
        model.load_weights(bad.items())


def test_quantization_and_lora_are_refused(paths: Callable[[str], Path]) -> None:
    from tokenwire.runtime.models.layers.quant.registry import resolve_quant_config

    path = paths("qwen3_moe")
    arch = ModelArch.from_hf_config(json.loads((path / "config.json").read_text()))
    quant = resolve_quant_config("int8", {})
    assert quant is not None
    with pytest.raises(ValueError, match="quantization 'int8' is not supported for mixture"):
        build_model(arch, torch.device("cpu"), torch.float32, 64, quant=quant)
    with pytest.raises(ValueError, match="enable-lora is not supported for mixture-of-experts"):
        LLM(str(path), device="cpu", enable_lora=True, max_loras=1)


# ----------------------------------------------------------------------------- TP
@pytest.fixture(scope="module")
def ranks() -> Iterator[GlooRanks]:
    pool = GlooRanks(2)
    try:
        yield pool
    finally:
        pool.close()


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_qwen2_moe_tp2_gloo_ranks_match_tp1(
    load_format: str, ranks: GlooRanks, paths: Callable[[str], Path]
) -> None:
    """Every expert's width, the shared expert and the dense layer split over 2 gloo ranks
    (one all-reduce per MoE block); loaded weights and seeded dummy weights both equal TP=1."""
    path = str(paths("qwen2_moe"))
    ref = run_rank(TPGroup.single(), path, load_format)
    results = ranks.run(run_rank, path, load_format)
    assert_ranks_identical(results)
    assert_same_run(results[0], ref)
