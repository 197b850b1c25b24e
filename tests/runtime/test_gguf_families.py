"""GGUF architectures beyond the Llama-shaped ones: ``qwen3moe``, ``gemma2``, ``gemma3``, ``phi3``.

Each tiny random HF model is written as a GGUF the way llama.cpp's converter does
(``gguf_families``: gguf-py's tensor names, stacked experts, Gemma's ``1 + w`` norms, Phi-3's
fused q/k/v and gate/up), in F32 and in Q8_0 (linear weights). Then:

- ``iter_gguf_weights`` yields exactly the HF weights the file holds, under HF names (Phi-3's
  fused tensors split into q/k/v and gate/up, experts one matrix each), bit for bit;
- tokenwire's float32 greedy tokens equal HF ``generate()`` on those (de-quantized) weights:
  the Q8_0 files load kept quantized (``--quantization gguf``: int8 linears read by the
  reader straight from the file; Qwen3-MoE's experts de-quantized, they run float); the F32
  files (no kept-quantized layer: the loader reads the converted checkpoint) load the
  reader's output as that checkpoint;
- transformers' config of the file (what ``gguf_convert`` writes) merged with
  ``gguf.config.hf_config_keys`` equals the source config as tokenwire reads it
  (``ModelArch``); transformers' alone misses Qwen3-MoE's expert width, Gemma's soft-caps and
  query scale, Gemma 3's rope scaling and Phi-3's LongRoPE;
- an architecture the reader does not know is a ValueError naming it.

The converted-directory cache is pre-seeded with config.json (no tokenizer: prompts are
token ids), so transformers never converts these files.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_families import TINY, write_family_gguf
from parity import distinct_prompts, hf_greedy
from safetensors.torch import save_file
from tiny_models import build_tiny_model

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.gguf import GGUFInt4, GGUFInt8, iter_gguf_weights
from tokenwire.runtime.loader.gguf.config import hf_config_keys
from tokenwire.runtime.loader.gguf_convert import converted_dir
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.sampling_params import SamplingParams

ARCHS = sorted(TINY)
PROMPTS = distinct_prompts()[:3]
NEW_TOKENS = 32  # parity.hf_greedy's length


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            family, overrides = TINY[arch]
            cache[arch] = build_tiny_model(family, tmp_path_factory.mktemp(arch), **overrides)
        return cache[arch]

    return get


def read_float(path: Path) -> dict[str, torch.Tensor]:
    """The reader's weights, records de-quantized (float32)."""
    out = {}
    for name, weight in iter_gguf_weights(path):
        if isinstance(weight, GGUFInt4 | GGUFInt8):
            out[name] = weight.dequantize().float()
        else:
            out[name] = weight
    return out


def split_fused(reference: dict[str, torch.Tensor], src: Path) -> dict[str, torch.Tensor]:
    """HF's fused Phi-3 tensors as their per-projection parts (what the reader yields)."""
    cfg = json.loads((src / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    inter = cfg["intermediate_size"]
    sizes = {"self_attn.qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
             "mlp.gate_up_proj": (("gate_proj", inter), ("up_proj", inter))}  # fmt: skip
    out = {}
    for name, value in reference.items():
        fused = next((f for f in sizes if f".{f}." in name), None)
        if fused is None:
            out[name] = value
            continue
        stem = fused.rpartition(".")[0]
        for part, chunk in zip(
            sizes[fused], value.split([n for _, n in sizes[fused]]), strict=True
        ):
            out[name.replace(fused, f"{stem}.{part[0]}")] = chunk
    return out


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_reader_yields_the_hf_weights(
    arch: str, qtype: QT, source: Callable[[str], Path], tmp_path: Path
) -> None:
    src = source(arch)
    reference = write_family_gguf(src, tmp_path / f"{arch}.gguf", arch, qtype)
    got = read_float(tmp_path / f"{arch}.gguf")
    want = split_fused(reference, src)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], value), name
    if qtype == QT.Q8_0:  # linears kept as int8 records; experts de-quantized (they run float)
        kinds = {n: type(w).__name__ for n, w in iter_gguf_weights(tmp_path / f"{arch}.gguf")
                 if n.endswith("_proj.weight")}  # fmt: skip
        assert kinds
        for name, kind in kinds.items():
            assert kind == ("Tensor" if ".experts." in name else "GGUFInt8"), name


def _seed(gguf_path: Path, src: Path, state: dict[str, torch.Tensor] | None) -> None:
    target = converted_dir(gguf_path)
    target.mkdir(parents=True)
    shutil.copy(src / "config.json", target / "config.json")
    if state is not None:
        save_file({k: v.contiguous() for k, v in state.items()}, str(target / "model.safetensors"))


def held(llm: LLM) -> dict[str, str | None]:
    """Each decoder linear of the model: what it holds prepared (None: a float weight)."""
    model = llm.engine.executor.worker.runner.model  # type: ignore[attr-defined]
    linears = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    return {
        name: next((k for k in ("w4a16", "w8a16") if k in module.__dict__), None)
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in linears and ".experts." not in name
    }


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf(
    arch: str,
    qtype: QT,
    source: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENWIRE_CACHE_DIR", str(tmp_path / "cache"))
    src = source(arch)
    path = tmp_path / f"{arch}.gguf"
    reference = write_family_gguf(src, path, arch, qtype)
    kept = qtype == QT.Q8_0
    _seed(path, src, None if kept else read_float(path))
    llm = LLM(
        str(path), device="cpu", dtype="float32", quantization="gguf" if kept else None,
        num_gpu_blocks_override=64,
    )  # fmt: skip
    assert llm.engine.facts.quantization == ("gguf" if kept else None)
    if kept:  # every attention linear (and the dense MLP's) holds int8 codes
        assert set(held(llm).values()) == {"w8a16"}
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file({k: v.contiguous() for k, v in reference.items()}, str(hf_dir / "model.safetensors"))
    shutil.copy(src / "config.json", hf_dir / "config.json")
    assert _greedy(llm) == hf_greedy(hf_dir, PROMPTS)
    llm.shutdown()


# Tiny configs that follow llama.cpp's rules where GGUF has no key: Gemma's query scale
# (query_pre_attn_scalar = head_dim below 27B) and Gemma 3's pattern (every 6th layer global).
_LLAMA_CPP_RULES: dict[str, dict[str, Any]] = {
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3": {"query_pre_attn_scalar": 16, "sliding_window_pattern": 6},
}
# What a tokenizer-less tiny GGUF cannot carry (vocabulary and special tokens come with the
# tokenizer metadata), and rms_norm_eps, which GGUF stores as float32.
_NOT_COMPARED = ("vocab_size", "bos_token_id", "eos_token_ids", "rms_norm_eps")


def _arch_diff(cfg: dict[str, Any], want: ModelArch) -> dict[str, Any]:
    from transformers import AutoConfig

    full = AutoConfig.for_model(**cfg).to_dict()
    full["architectures"] = [want.architecture]
    got = ModelArch.from_hf_config(full)
    return {
        k: (getattr(got, k), getattr(want, k))
        for k in want.__dataclass_fields__
        if k not in _NOT_COMPARED and getattr(got, k) != getattr(want, k)
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_config_keys_complete_transformers_config(arch: str, tmp_path: Path) -> None:
    """transformers' GGUF config + ``hf_config_keys`` = the source model's config (as
    tokenwire reads it); transformers' alone is not."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    family, overrides = TINY[arch]
    src = build_tiny_model(family, tmp_path / "src", **overrides, **_LLAMA_CPP_RULES.get(arch, {}))
    path = tmp_path / f"{arch}.gguf"
    write_family_gguf(src, path, arch, QT.F32)
    want = ModelArch.from_hf_config(json.loads((src / "config.json").read_text()))
    base = load_gguf_checkpoint(str(path))["config"]
    assert _arch_diff({**base, **hf_config_keys(path)}, want) == {}
    assert _arch_diff(base, want) != {}


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(tmp_path / "x.gguf", "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'mamba' is not supported.*gemma2.*phi3"):
        list(iter_gguf_weights(tmp_path / "x.gguf"))
