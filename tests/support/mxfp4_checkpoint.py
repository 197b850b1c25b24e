"""MXFP4 test checkpoints: quantize a tiny gpt-oss's experts into the published layout.

``write_mxfp4_pair`` turns a tiny HF gpt-oss folder (``build_tiny_model``) into two folders:
``mxfp4/`` holds the experts as ``*_blocks`` / ``*_scales`` (the layout of openai/gpt-oss-20b,
with its ``quantization_config``), ``reference/`` the same model with those experts
de-quantized (float32, exact), which HF transformers loads as the parity reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenwire.runtime.models.mxfp4 import BLOCK_SIZE, FP4_E2M1_VALUES, dequantize_mxfp4

MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
    ],
}  # fmt: skip


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[..., K]`` -> (uint8 blocks ``[..., K/32, 16]``, uint8 scales ``[..., K/32]``):
    each block's scale is the smallest power of two that fits its largest magnitude into
    E2M1's 6, each value the nearest code (ties to the lower code)."""
    blocks = weight.float().unflatten(-1, (-1, BLOCK_SIZE))  # [..., G, 32]
    amax = blocks.abs().amax(dim=-1).clamp_min(2.0**-140)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.pow(2.0, exponent).unsqueeze(-1)
    lut = torch.tensor(FP4_E2M1_VALUES)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(dim=-1).to(torch.uint8)  # [..., G, 32]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8)


def _expert_tensors(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Reference and MXFP4 tensors for every fused expert matrix of ``state``."""
    reference, quantized = {}, {}
    for name, tensor in state.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        rows = tensor.transpose(1, 2)  # [E, out, in]: what the blocks hold
        blocks, scales = quantize_mxfp4(rows)
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        reference[name] = (
            dequantize_mxfp4(blocks, scales, f"{name}_blocks").transpose(1, 2).contiguous()
        )
    return {"reference": reference, "mxfp4": quantized}


def write_mxfp4_pair(src: Path, out: Path) -> tuple[Path, Path]:
    """``src`` (a one-file tiny gpt-oss) -> (``out/mxfp4``, ``out/reference``)."""
    (weights_file,) = src.glob("*.safetensors")
    state = load_file(str(weights_file))
    experts = _expert_tensors(state)
    config = json.loads((src / "config.json").read_text())
    for kind in ("mxfp4", "reference"):
        folder = out / kind
        shutil.copytree(src, folder)
        kept = {n: t.contiguous() for n, t in state.items() if n not in experts["reference"]}
        save_file({**kept, **experts[kind]}, str(folder / weights_file.name), {"format": "pt"})
        if kind == "mxfp4":
            folder_config = {**config, "quantization_config": MXFP4_CONFIG}
            (folder / "config.json").write_text(json.dumps(folder_config, indent=2))
    return out / "mxfp4", out / "reference"
