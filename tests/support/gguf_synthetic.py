"""Tiny synthetic llama GGUFs written with ``gguf.GGUFWriter`` for the kept-quantized tests
(``tests/runtime/test_gguf_quantized.py``, ``test_gguf_kquant.py``): each linear stored in the
type a test picks (K-quants as random super-blocks), the float32 weights it de-quantizes to by
``gguf.quants.dequantize`` (the reference), the converted-directory cache pre-seeded, and HF
``generate()`` on those weights."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf_layout import K_QUANT_BYTES, llama_cpp_permute, random_k_quant, unpermute
from parity import hf_greedy
from safetensors.torch import load_file

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.gguf_convert import converted_dir
from tokenwire.runtime.sampling_params import SamplingParams

HEADS, KV_HEADS = 4, 2
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    stem = hf.removesuffix(".weight")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.weight"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{_BLOCK[part]}.weight"


def write_synthetic(
    src: Path, out: Path, types: Callable[[str], QT]
) -> tuple[Path, dict[str, torch.Tensor]]:
    """GGUF of the tiny HF model at ``src`` (linear ``hf`` stored as ``types(hf)``; K-quants as
    random super-blocks, gguf-py cannot write them), and the HF-named float32 weights it
    de-quantizes to (the reference)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_block_count(2)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    reference: dict[str, torch.Tensor] = {}
    for hf, tensor in load_file(src / "model.safetensors").items():
        data = tensor.float().numpy()
        heads = HEADS if ".q_proj." in hf else KV_HEADS if ".k_proj." in hf else 0
        qtype = types(hf) if "_proj." in hf else QT.F32
        stored = llama_cpp_permute(data, heads) if heads else data
        if qtype == QT.F32:
            writer.add_tensor(gguf_name(hf), stored)
            back = stored
        else:
            k_quant = qtype.name in K_QUANT_BYTES
            raw = (random_k_quant(stored.shape, qtype, rng) if k_quant
                   else gguf.quants.quantize(stored, qtype))  # fmt: skip
            writer.add_tensor(gguf_name(hf), raw, raw_dtype=qtype)
            back = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        reference[hf] = torch.from_numpy(unpermute(back, heads) if heads else back.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out, reference


def seed_cache(gguf_path: Path, src: Path, state: dict[str, torch.Tensor] | None) -> None:
    """What ``ensure_converted`` would write: config.json, no tokenizer, and the de-quantized
    weights only when given (a kept-quantized load must not need them)."""
    from safetensors.torch import save_file

    target = converted_dir(gguf_path)
    target.mkdir(parents=True)
    shutil.copy(src / "config.json", target / "config.json")
    if state is not None:
        save_file({k: v.contiguous() for k, v in state.items()}, str(target / "model.safetensors"))


def hf_reference(
    src: Path, state: dict[str, torch.Tensor], out: Path, prompts: list[list[int]]
) -> list[list[int]]:
    from safetensors.torch import save_file

    out.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    shutil.copy(src / "config.json", out / "config.json")
    return hf_greedy(out, prompts)


def greedy(llm: LLM, prompts: list[list[int]] | list[str], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
