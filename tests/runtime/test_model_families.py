"""Gemma 2, Gemma 3 (text) and Phi-3 beyond the shared harness (``test_hf_parity``,
``test_model_forward``): config keys read as HF reads them (hub-style files without
``layer_types``, legacy rope keys), each family feature shown to matter for the tiny configs,
LongRoPE's long factors and attention factor against HF greedy decoding, soft-capped paged
attention against the dense oracle, GeGLU's Triton kernel, and TP=2 equal to TP=1."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from forward_inputs import Chunk, hf_logits, new_kv_caches, run_step, tokens_for
from kernel_inputs import build_metadata, new_cache, scatter_blocks
from tiny_models import build_tiny_model
from tp_ranks import assert_ranks_identical, assert_same_run, run_rank, run_threads
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tokenwire.kernels.activation import gelu_tanh_and_mul_ref
from tokenwire.kernels.activation_triton import gelu_tanh_and_mul_triton
from tokenwire.kernels.paged_attention import paged_attention, paged_attention_dense_ref
from tokenwire.kernels.rotary import compute_inv_freq, rope_attention_scaling
from tokenwire.kernels.store_kv import store_kv
from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.bundled_configs import bundled_config_path
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.sampling_params import SamplingParams

# The Triton kernels are defined interpreted by the root conftest (interpreted_kernels.py).
ON_CUDA = torch.cuda.is_available()

NEW_FAMILIES = ["gemma2", "gemma3_text", "phi3"]
# google/gemma-3-1b-it's config.json: no layer_types, legacy rope keys.
GEMMA3_1B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26,
    "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "vocab_size": 262144,
}  # fmt: skip
# Phi-3.5-mini's kind of LongRoPE config (factor lists shortened to 4 entries).
PHI35_STYLE: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "vocab_size": 100, "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "sliding_window": 262144,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.02, 1.1, 1.3],
                     "long_factor": [1.08, 1.3, 4.5, 20.0]},
}  # fmt: skip


# ----------------------------------------------------------------------------- config keys
def _windows_from_hf(layer_types: list[str], window: int) -> tuple[int | None, ...]:
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def test_gemma2_hub_config_fields() -> None:
    path = bundled_config_path("gemma-2-2b")
    assert path is not None
    cfg = json.loads(path.read_text())
    arch = ModelArch.from_hf_config(cfg)
    hf = Gemma2Config(**cfg)
    assert arch.layer_sliding_window == _windows_from_hf(hf.layer_types, 4096)
    assert arch.layer_sliding_window[:2] == (4096, None) and arch.sliding_window == 4096
    assert arch.tie_word_embeddings  # the file has no tie_word_embeddings key: HF ties
    assert (arch.attn_logit_softcap, arch.final_logit_softcap) == (50.0, 30.0)
    assert arch.attention_scale == 256**-0.5 and arch.embed_scale == math.sqrt(2304)
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.norm_unit_offset
    assert arch.sandwich_norms and not arch.qk_norm and arch.sliding_rope_theta is None


def test_gemma3_hub_config_fields() -> None:
    arch = ModelArch.from_hf_config(GEMMA3_1B)
    hf = Gemma3TextConfig(**copy.deepcopy(GEMMA3_1B))
    assert arch.layer_sliding_window == _windows_from_hf(hf.layer_types, 512)
    assert [i for i in range(26) if arch.layer_window(i) is None] == [5, 11, 17, 23]
    assert (arch.rope_theta, arch.sliding_rope_theta, arch.rope_scaling) == (1e6, 1e4, None)
    assert arch.layer_uses_local_rope(0) and not arch.layer_uses_local_rope(5)
    assert arch.qk_norm and arch.attn_logit_softcap is None and arch.final_logit_softcap is None
    assert arch.eos_token_ids == (1, 106)
    # Gemma 3 4B+: linear scaling on the global layers only; the v5 nested style too.
    linear = {"rope_type": "linear", "factor": 8.0}
    scaled = ModelArch.from_hf_config({**GEMMA3_1B, "rope_scaling": linear})
    assert scaled.rope_scaling_dict() == linear and scaled.sliding_rope_theta == 1e4
    v5_cfg = Gemma3TextConfig(
        **{**copy.deepcopy(GEMMA3_1B), "rope_scaling": dict(linear)}
    ).to_dict()
    assert "full_attention" in v5_cfg["rope_parameters"]
    v5 = ModelArch.from_hf_config(v5_cfg)
    assert (v5.rope_theta, v5.sliding_rope_theta) == (1e6, 1e4)
    assert v5.rope_scaling_dict() == linear
    assert v5.layer_sliding_window == arch.layer_sliding_window


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),  # Phi-4-mini's rope
        ({"hidden_activation": "gelu"}, "hidden_activation"),  # exact GELU: not implemented
        ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
         "sliding-window layers"),
    ],
)  # fmt: skip
def test_unimplemented_keys_are_refused(change: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ModelArch.from_hf_config({**GEMMA3_1B, **change})


@pytest.mark.parametrize("max_position", [4096, 131072])
def test_phi3_longrope_matches_hf_rope_init(max_position: int) -> None:
    """Legacy ``type: longrope`` with the pretraining length only at top level: factor
    131072/4096 = 32 and HF's attention factor; short factors within 4096, long beyond."""
    arch = ModelArch.from_hf_config(PHI35_STYLE)
    scaling = arch.rope_scaling_dict()
    assert scaling is not None and scaling["rope_type"] == "longrope"
    assert scaling["factor"] == 32.0 and scaling["original_max_position_embeddings"] == 4096
    assert arch.fused_checkpoint_projections and arch.layer_window(1) == 262144
    hf = Phi3Config(**copy.deepcopy(PHI35_STYLE))  # HF edits the rope dict in place
    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS["longrope"](hf, None, seq_len=max_position)
    ours = compute_inv_freq(arch.head_dim, arch.rope_theta, scaling, max_position)
    assert torch.equal(ours, hf_inv)
    assert rope_attention_scaling(scaling) == hf_scale
    assert hf_scale == math.sqrt(1 + math.log(32) / math.log(4096))
    legacy = {**PHI35_STYLE["rope_scaling"], "type": "su"}
    assert ModelArch.from_hf_config({**PHI35_STYLE, "rope_scaling": legacy}) == arch


def test_qwen2_windows_follow_max_window_layers() -> None:
    from transformers import Qwen2Config

    cfg = dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=2, max_position_embeddings=64,
        use_sliding_window=True, sliding_window=32, max_window_layers=2,
    )  # fmt: skip
    arch = ModelArch.from_hf_config(cfg)
    assert arch.layer_sliding_window == _windows_from_hf(Qwen2Config(**cfg).layer_types, 32)
    off = ModelArch.from_hf_config({**cfg, "use_sliding_window": False})
    assert off.sliding_window is None and off.layer_sliding_window == (None,) * 4


# ----------------------------------------------------------------------------- features matter
@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[LoadedModel, Any]]:
    cache: dict[str, tuple[LoadedModel, Any]] = {}

    def get(family: str) -> tuple[LoadedModel, Any]:
        if family not in cache:
            path = build_tiny_model(family, tmp_path_factory.mktemp(f"fam-{family}"))
            ours = load_model(ModelConfig(model=str(path)), torch.device("cpu"), torch.float32)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[family] = (ours, hf)
        return cache[family]

    return get


def _no_attn_softcap(model: Any) -> None:
    for layer in model.model.layers:
        layer.self_attn.logits_soft_cap = None


def _no_embed_scale(model: Any) -> None:
    model.model.embed_scale = None


def _global_rope_everywhere(model: Any) -> None:
    model.local_rope = (False,) * len(model.local_rope)


def _no_post_ffn_norm(model: Any) -> None:
    for layer in model.model.layers:
        layer.post_feedforward_layernorm = torch.nn.Identity()


def _swapped_gate_up(model: Any) -> None:
    for layer in model.model.layers:
        weight = layer.mlp.gate_up_proj.weight
        weight.copy_(weight.roll(weight.shape[0] // 2, dims=0))


ABLATIONS: dict[str, tuple[str, Callable[[Any], None]]] = {
    "gemma2-attn-softcap": ("gemma2", _no_attn_softcap),
    "gemma2-embed-scale": ("gemma2", _no_embed_scale),
    "gemma2-sandwich-norm": ("gemma2", _no_post_ffn_norm),
    "gemma3-local-rope": ("gemma3_text", _global_rope_everywhere),
    "phi3-gate-up-order": ("phi3", _swapped_gate_up),
}


@pytest.mark.parametrize("name", sorted(ABLATIONS))
@torch.no_grad()
def test_each_feature_moves_the_logits(
    name: str, loaded: Callable[[str], tuple[LoadedModel, Any]], tmp_path: Path
) -> None:
    """Parity is no accident: the tiny configs exercise each feature. Matching HF within
    1e-4, then disabling the feature in a fresh copy of the model moves logits well past it."""
    family, ablate = ABLATIONS[name]
    ours, hf = loaded(family)
    tokens = tokens_for(3, 40)
    ref = hf_logits(hf, tokens)
    chunks = [Chunk(tokens, 0, [1, 2, 3])]
    assert (run_step(ours.model, new_kv_caches(ours.model), chunks) - ref).abs().max() <= 1e-4
    copy = load_model(ModelConfig(model=str(ours.model_path)), torch.device("cpu"), torch.float32)
    ablate(copy.model)
    assert (run_step(copy.model, new_kv_caches(copy.model), chunks) - ref).abs().max() > 1e-2


def test_final_softcap_bounds_logits(loaded: Callable[[str], tuple[LoadedModel, Any]]) -> None:
    ours, hf = loaded("gemma2")
    hidden = torch.randn(4, ours.arch.hidden_size) * 10
    logits = ours.model.compute_logits(hidden)
    raw = hidden @ hf.lm_head.weight.T
    assert logits.abs().max() <= 4.0 < raw.abs().max()
    assert torch.allclose(logits, torch.tanh(raw / 4.0) * 4.0, atol=1e-5)


# ----------------------------------------------------------------------------- LongRoPE e2e
def test_phi3_longrope_long_and_short_factors_match_hf_generate(tmp_path: Path) -> None:
    """Pretraining length 64 of a 512-token context: factor 8, attention factor
    sqrt(1 + ln 8 / ln 64). Served at max_model_len 64 the short factors apply (HF: every
    sequence <= 64 tokens); served at 512 the long ones (HF: prompts already past 64)."""
    path = build_tiny_model("phi3", tmp_path, original_max_position_embeddings=64)
    arch = ModelArch.from_hf_config(json.loads((path / "config.json").read_text()))
    assert rope_attention_scaling(arch.rope_scaling_dict()) == pytest.approx(math.sqrt(1.5))
    params = SamplingParams(temperature=0.0, max_tokens=12)
    short_prompts = [tokens_for(40 + i, n) for i, n in enumerate((9, 30, 50))]
    long_prompts = [tokens_for(50 + i, n) for i, n in enumerate((65, 90))]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompts, max_model_len in ((short_prompts, 64), (long_prompts, 512)):
        llm = LLM(str(path), device="cpu", max_model_len=max_model_len)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == [_hf_generate(hf, p, 12) for p in prompts], max_model_len


@torch.inference_mode()
def _hf_generate(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return list(ids[0, len(prompt) :].tolist())


# ----------------------------------------------------------------------------- kernels
@torch.no_grad()
def test_softcapped_paged_attention_matches_dense_oracle() -> None:
    """Decode groups, a fresh prefill and cached-prefix prefills, GQA 8/2, cap 2.0."""
    gen = torch.Generator().manual_seed(3)
    shape = [(1, 37), (1, 5), (1, 129), (20, 20), (13, 50), (16, 48)]
    seqs, num_blocks = scatter_blocks(shape, 16, gen)
    k_cache, v_cache = new_cache(num_blocks, 16, 2, 16, gen)
    meta = build_metadata(seqs, 16)
    query = torch.randn(meta.num_tokens, 8, 16, generator=gen) * 2
    key = torch.randn(meta.num_tokens, 2, 16, generator=gen) * 2
    value = torch.randn(meta.num_tokens, 2, 16, generator=gen)
    store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    args = (k_cache, v_cache, meta, 0.25)
    capped = paged_attention(query, key, value, *args, logits_soft_cap=2.0)
    oracle = paged_attention_dense_ref(query, *args, logits_soft_cap=2.0)
    torch.testing.assert_close(capped, oracle, atol=1e-5, rtol=0)
    plain = paged_attention(query, key, value, *args)
    assert (plain - capped).abs().max() > 0.1


@pytest.mark.parametrize("inter", [96, 1500])
def test_gelu_tanh_and_mul_triton_matches_reference(
    inter: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if ON_CUDA else "cpu")
    x = torch.randn(2, 3, 2 * inter, generator=torch.Generator().manual_seed(4)).to(device) * 4
    ref = gelu_tanh_and_mul_ref(x)
    err = (gelu_tanh_and_mul_triton(x) - ref).abs() / ref.abs().clamp_min(1.0)
    assert err.max() < 1e-5


# ----------------------------------------------------------------------------- TP
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_tp2_thread_ranks_match_tp1(family: str, tmp_path: Path) -> None:
    """Heads, the MLP and the vocabulary split over 2 ranks (in-memory collectives): Phi-3's
    fused checkpoint tensors load as per-rank slices, Gemma's soft-caps and scaled embeddings
    hold under the all-reduce / all-gather; Gemma 3's single KV head is replicated."""
    path = str(build_tiny_model(family, tmp_path))
    ref = run_rank(TPGroup.single(), path)
    results = run_threads(2, path)
    assert_ranks_identical(results)
    assert_same_run(results[0], ref)


# ----------------------------------------------------------------------------- LoRA
def test_gemma2_lora_adapter_matches_peft(tmp_path: Path) -> None:
    """A PEFT adapter on every projection of Gemma 2 (q/k/v/o, gate/up/down): greedy tokens
    equal transformers + peft, mixed in one batch with base-model rows."""
    from peft_reference import hf_lora_greedy, write_adapter

    from tokenwire.runtime.lora.request import LoRARequest

    base = build_tiny_model("gemma2", tmp_path / "base")
    adapter = write_adapter(base, tmp_path / "adapter", rank=8, seed=1)
    prompts = [tokens_for(60, 30), tokens_for(61, 7)]
    want, plain = (hf_lora_greedy(base, a, prompts, 8) for a in (adapter, None))
    assert want != plain  # the adapter changes the output
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=1)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    request = LoRARequest("a", 1, str(adapter))
    loras = [request, request, None, None]
    outs = llm.generate(prompts * 2, params, lora_request=loras, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[:2] == want and got[2:] == plain
