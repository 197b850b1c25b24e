"""Bundled benchmark configs: exact shapes, selection by name, dummy models without a tokenizer,
and the H200 floors derived from them (issue 6's published figures)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenwire.bench.roofline import (
    DEVICES,
    H200,
    decode_step_floor_s,
    lookup_device,
    model_cost,
    workload_floor,
)
from tokenwire.bench.workloads import make_workload
from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.loader.bundled_configs import (
    BUNDLED_CONFIGS,
    bundled_config_path,
    canonical_name,
)
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.qwen_vl_config import is_qwen_vl, qwen_vl_text_config

# name -> (architecture, hidden, layers, q heads, kv heads, head_dim, vocab, tied)
EXPECTED = {
    "llama-3.2-1b": ("LlamaForCausalLM", 2048, 16, 32, 8, 64, 128256, True),
    "qwen3-0.6b": ("Qwen3ForCausalLM", 1024, 28, 16, 8, 128, 151936, True),
    "llama-3.1-8b": ("LlamaForCausalLM", 4096, 32, 32, 8, 128, 128256, False),
    "gemma-2-2b": ("Gemma2ForCausalLM", 2304, 26, 8, 4, 256, 256000, True),
    "phi-3-mini-4k": ("Phi3ForCausalLM", 3072, 32, 32, 32, 96, 32064, False),
    "mixtral-8x7b": ("MixtralForCausalLM", 4096, 32, 32, 8, 128, 32000, False),
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", 2048, 48, 32, 4, 128, 151936, False),
    # MLA: one latent "KV head" of kv_lora_rank + qk_rope_head_dim = 512 + 64 features.
    "deepseek-v2-lite": ("DeepseekV2ForCausalLM", 2048, 27, 16, 1, 576, 102400, False),
    "gpt-oss-20b": ("GptOssForCausalLM", 2880, 24, 64, 8, 64, 201088, False),
    # Its language model (a Qwen2 with M-RoPE) is what the arch describes.
    "qwen2.5-vl-3b": ("Qwen2ForCausalLM", 2048, 36, 16, 2, 128, 151936, True),
}
# Tiny sizes per family for the dummy-engine run (family flags of the bundled config kept).
_TINY_MLA = {
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "num_key_value_heads": 4,
}  # fmt: skip
_TINY_GPT_OSS = {
    "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
}  # fmt: skip
_TINY_FAMILY = {"deepseek-v2-lite": _TINY_MLA, "gpt-oss-20b": _TINY_GPT_OSS}
# The vision tower of a vision-language config, as published.
EXPECTED_VISION = {
    "qwen2.5-vl-3b": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                          patch_size=14, spatial_merge_size=2, out_hidden_size=2048),
}  # fmt: skip


def _arch(name: str) -> ModelArch:
    path = bundled_config_path(name)
    assert path is not None
    config = json.loads(path.read_text())
    if is_qwen_vl(config):  # the language model's shape, as the loader builds it
        config = qwen_vl_text_config(config)
    return ModelArch.from_hf_config(config)


@pytest.mark.parametrize("name", list(BUNDLED_CONFIGS))
def test_bundled_config_loads_into_arch(name: str) -> None:
    a = _arch(name)
    got = (
        a.architecture, a.hidden_size, a.num_hidden_layers, a.num_attention_heads,
        a.num_key_value_heads, a.head_dim, a.vocab_size, a.tie_word_embeddings,
    )  # fmt: skip
    assert got == EXPECTED[name]
    assert a.qk_norm == name.startswith("qwen3")
    if name.startswith("llama"):
        assert dict(a.rope_scaling or ())["rope_type"] == "llama3"
    path = bundled_config_path(name)
    assert path is not None
    vision = json.loads(path.read_text()).get("vision_config")
    if name in EXPECTED_VISION:
        assert {k: vision[k] for k in EXPECTED_VISION[name]} == EXPECTED_VISION[name]
    else:
        assert vision is None


def test_new_families_arch_facts() -> None:
    """DeepSeek-V2-Lite: MLA without q_lora, KV bytes per token = layers x (kv_lora_rank +
    qk_rope_head_dim) x 2 bytes (one latent, no separate V); 64 routed experts (top 6), 2
    shared, the first layer dense. gpt-oss-20b: sinks, alternating 128-token windows, 32
    experts top 4. Both: roofline weights near the published sizes (15.7B / 20.9B params;
    bf16 dummy weights) and the per-token (batch-1) reads near the active parameters."""
    lite, oss = _arch("deepseek-v2-lite"), _arch("gpt-oss-20b")
    mla, moe = lite.mla, lite.moe
    assert mla is not None and moe is not None and mla.q_lora_rank is None
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, lite.kv_cache_parts) == (512, 64, 1)
    assert (moe.num_experts, moe.top_k, moe.sparse_layers[:2]) == (64, 6, (False, True))
    lite_cost = model_cost(lite, 2)
    assert lite_cost.kv_bytes_per_token == 27 * (512 + 64) * 2
    assert lite_cost.weight_bytes / 2 == pytest.approx(15.7e9, rel=0.03)
    assert lite_cost.step_weight_bytes(1) / 2 == pytest.approx(2.4e9, rel=0.05)
    assert oss.attention_sinks and oss.moe is not None and oss.moe.top_k == 4
    assert (oss.layer_window(0), oss.layer_window(1), oss.kv_cache_parts) == (128, None, 2)
    oss_cost = model_cost(oss, 2)
    assert oss_cost.kv_bytes_per_token == 2 * 24 * 8 * 64 * 2
    assert oss_cost.weight_bytes / 2 == pytest.approx(20.9e9, rel=0.05)
    assert oss_cost.step_weight_bytes(1) / 2 == pytest.approx(3.6e9, rel=0.05)


def test_names_and_hf_ids_resolve() -> None:
    assert canonical_name("meta-llama/Llama-3.2-1B") == "llama-3.2-1b"
    assert canonical_name("Qwen3-0.6B") == "qwen3-0.6b"
    assert canonical_name("llama-3.1-8b") == "llama-3.1-8b"
    assert canonical_name("deepseek-ai/DeepSeek-V2-Lite") == "deepseek-v2-lite"
    assert canonical_name("openai/gpt-oss-20b") == "gpt-oss-20b"
    assert canonical_name("gpt2") is None


def test_loader_resolves_bundled_name_only_for_dummy() -> None:
    from tokenwire.runtime.loader.source import model_source

    source = model_source(ModelConfig(model="llama-3.2-1b", load_format="dummy"))
    assert source.config_file == bundled_config_path("llama-3.2-1b")
    assert source.served_name == "llama-3.2-1b"
    with pytest.raises(ValueError, match=r"bundled configs: llama-3\.2-1b"):
        model_source(ModelConfig(model="no-such-model", load_format="dummy"))
    with pytest.raises(ValueError, match="does not exist"):
        model_source(ModelConfig(model="llama-3.2-1b"))


def _shrunk(name: str, out: Path) -> Path:
    """The bundled config with tiny sizes; family flags (rope scaling, q/k norm, tying) kept."""
    path = bundled_config_path(name)
    assert path is not None
    cfg: dict[str, Any] = json.loads(path.read_text())
    cfg.update(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    cfg.update(_TINY_FAMILY.get(name, {}))
    if "vision_config" in cfg:  # a tiny tower whose output is the tiny text width
        cfg["vision_config"].update(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            fullatt_block_indexes=[1],
        )  # fmt: skip
        cfg["rope_scaling"]["mrope_section"] = [2, 3, 3]  # head_dim 16
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        Qwen2VLImageProcessorPil().save_pretrained(out)  # a VLM's folder needs its processor
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("name", list(BUNDLED_CONFIGS))
def test_shrunken_bundled_config_runs_dummy_engine_with_token_ids(
    name: str, tmp_path: Path
) -> None:
    from tokenwire.runtime.llm import LLM
    from tokenwire.runtime.sampling_params import SamplingParams

    llm = LLM(str(_shrunk(name, tmp_path)), load_format="dummy", device="cpu")
    assert llm.get_tokenizer() is None  # no tokenizer files: token ids only
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=5)
    outs = llm.generate([[5, 6, 7, 8], list(range(3, 40))], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]


def test_hf_baseline_builds_dummy_model_from_config(tmp_path: Path) -> None:
    from tokenwire.bench.hf_baseline import HfBaselineConfig, compare_hf

    folder = _shrunk("llama-3.2-1b", tmp_path)
    workload = make_workload("fixed", 512, 2)
    workload = type(workload)(workload.name, [p[:16] for p in workload.prompts], [3, 3])
    config = HfBaselineConfig(batch_sizes=(2,), num_requests=None, sequential_requests=0)
    out = compare_hf(config, folder, torch.device("cpu"), torch.float32, workload)
    assert out["hf_static_best_batch"] == 2 and out["hf_static_output_tok_s"] > 0
    assert "hf_sequential_output_tok_s" not in out


def test_floors_match_issue_figures() -> None:
    """Issue 6 (H200): TPOT floors 0.58 / 3.5 ms; mixed floors ~72k (1B), ~36k (0.6B),
    ~13.7k (8B)."""
    costs = {name: model_cost(_arch(name), 2) for name in BUNDLED_CONFIGS}
    one_b, eight_b = costs["llama-3.2-1b"], costs["llama-3.1-8b"]
    assert decode_step_floor_s(one_b, [0], H200) == pytest.approx(0.58e-3, rel=0.02)
    assert decode_step_floor_s(eight_b, [0], H200) == pytest.approx(3.53e-3, rel=0.02)
    mixed = make_workload("mixed", 128256)
    prompt_lens = [len(p) for p in mixed.prompts]
    expected = {"llama-3.2-1b": 72_000, "qwen3-0.6b": 36_000, "llama-3.1-8b": 13_700}
    for name, want in expected.items():
        floor = workload_floor(costs[name], prompt_lens, mixed.output_lens, 256, H200)
        assert floor.output_tok_s == pytest.approx(want, rel=0.1), name
        assert floor.decode_steps == max(mixed.output_lens)  # 256 requests fit 256 slots


def test_decode_steps_list_scheduling() -> None:
    from tokenwire.bench.roofline import decode_steps

    assert decode_steps([5, 5, 5], 3) == 5
    assert decode_steps([5, 5, 5], 1) == 15
    assert decode_steps([4, 1, 1, 3], 2) == 5  # slot 2 runs 1, 1, then 3: ends at 5


def test_roofline_table_picks_the_device_by_cuda_name() -> None:
    """H200 floors use the figures measured on the benchmark box (issue 6, gpu_check);
    every other device its datasheet's; unknown devices (the CPU) have no floor."""
    assert H200.bandwidth == 4.25e12 and H200.flops == 790e12 and H200.basis == "measured"
    assert H200.hbm_bytes_s == 4.8e12  # datasheet
    names = {
        "NVIDIA H200": "H200",
        "NVIDIA H200 NVL": "H200-NVL",
        "NVIDIA H100 80GB HBM3": "H100-SXM",
        "NVIDIA H100 PCIe": "H100-PCIe",
        "NVIDIA H100 NVL": "H100-NVL",
        "NVIDIA A100-SXM4-80GB": "A100-80GB-SXM",
        "NVIDIA A100 80GB PCIe": "A100-80GB-PCIe",
        "NVIDIA A100-SXM4-40GB": "A100-40GB",
        "NVIDIA L40S": "L40S",
        "NVIDIA L4": "L4",
        "h100-sxm": "H100-SXM",  # a table name, as --floor-device takes it
    }
    for cuda_name, entry in names.items():
        found = lookup_device(cuda_name)
        assert found is not None and found.name == entry, cuda_name
    for other in ("cpu", "NVIDIA L40", "NVIDIA GH200 480GB", "AMD Instinct MI300X", ""):
        assert lookup_device(other) is None, other
    for d in DEVICES:
        assert d.bandwidth > 0.2e12 and d.flops > 100e12 and d.basis in ("measured", "datasheet")
    assert len({d.name for d in DEVICES}) == len(DEVICES)


def test_throughput_floor_is_unknown_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    from tokenwire.bench.throughput import floor_device, floor_figures, print_table

    arch = _arch("llama-3.2-1b")
    workload = make_workload("cpu", 1000, 4)
    assert floor_device(torch.device("cpu")) is None
    unknown = floor_figures(arch, 2, workload, 256, None)
    assert unknown["floor_output_tok_s"] is None and unknown["tpot_floor_ms"] is None
    assert unknown["weight_bytes_per_step"] > 0
    h200 = floor_figures(arch, 2, workload, 256, floor_device(torch.device("cpu"), "H200"))
    assert h200["floor_device"] == "H200" and h200["floor_output_tok_s"] > 0
    assert h200["tpot_floor_ms"] == pytest.approx(0.58, rel=0.03)
    with pytest.raises(ValueError, match="--floor-device"):
        floor_device(torch.device("cpu"), "TPUv5")
    row = {
        "workload": "cpu", "model": "m", "device": "cpu", "dtype": "float32", "num_requests": 4,
        "prompt_tokens": 1, "output_tokens": 1, "tokenwire_output_tok_s": 10.0,
        "engine_overhead_ms_per_step": 1.0, "num_steps": 3,
    }  # fmt: skip
    print_table({**row, **unknown})
    assert "unknown" in capsys.readouterr().out
    print_table({**row, **h200})
    out = capsys.readouterr().out
    assert "H200 floor (4.25 TB/s, 790 TFLOP/s)" in out and "unknown" not in out
