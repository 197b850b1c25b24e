"""Quantized checkpoints written the way the real tools lay them out, from a tiny random HF
model, with an independent round-to-nearest reference (nothing here imports tokenwire).

- ``write_gptq``: AutoGPTQ's layout (``qweight`` int32 [K*bits/32, N], ``qzeros`` int32
  [G, N*bits/32] holding zero - 1 (v1, ``checkpoint_format: gptq``) or the zero (``gptq_v2``),
  ``scales`` float16 [G, N], ``g_idx`` int32 [K]) and its ``quantization_config``. The
  quantizer is AutoGPTQ's ``Quantizer.find_params`` (min/max over each group, symmetric: zero
  at 2**(bits-1)); act order (``desc_act``) draws a random permutation of the input rows
  and forms groups over consecutive permuted rows, so ``g_idx[k] = position(k) // group``
  (one permutation per input: q/k/v share one, gate/up another, as GPTQ's Hessian order).
- ``write_awq``: AutoAWQ's GEMM layout (``qweight`` int32 [K, N/8] and ``qzeros`` int32
  [G, N/8] packed in the order [0, 2, 4, 6, 1, 3, 5, 7], ``scales`` float16 [G, N]) with
  AutoAWQ's ``pseudo_quantize_tensor`` (asymmetric, zero point).
- ``int8_reference``: per-output-channel symmetric int8 (scale = max|w| / 127).
- ``write_fp8``: float8_e4m3fn ``weight`` + ``weight_scale`` as llm-compressor saves
  compressed-tensors ``float-quantized`` (``ct-tensor``: [1], ``ct-channel``: [N, 1], float16)
  and AutoFP8 / HF ``quant_method: fp8`` (``hf-tensor``: [] float32); ``fp8_online_reference``:
  ``--quantization fp8``'s per-row ``amax / 448`` rounding (torch's e4m3 cast).

Each returns the de-quantized state dict (float32, HF names): what HF transformers must run
to compute what the quantized checkpoint means. Everything else in the checkpoint (embeddings,
norms, LM head) is stored in float16, as the tools save a float16 model; the returned state
holds those float16 values too.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections that read the same input (and so share GPTQ's act-order permutation).
SAME_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class GPTQSpec:
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"
    zero_biases: bool = False  # (older) AutoGPTQ: a float16 zero bias on every linear


@dataclass(frozen=True)
class Quantized:
    tensors: dict[str, torch.Tensor]  # the checkpoint tensors of one linear (by suffix)
    dequantized: torch.Tensor  # float32 [N, K]


def _split(name: str) -> tuple[str, str, str]:
    """``model.layers.0.self_attn.q_proj.weight`` -> (module path, projection, leaf)."""
    module, _, leaf = name.rpartition(".")
    return module, module.rpartition(".")[2], leaf


def is_linear(name: str) -> bool:
    _, proj, leaf = _split(name)
    return proj in LINEARS and leaf == "weight"


# ----------------------------------------------------------------------------- GPTQ
def gptq_g_idx(k: int, group: int, desc_act: bool, gen: torch.Generator) -> torch.Tensor:
    """Group of each input row: sequential, or over a random act-order permutation."""
    order = torch.arange(k) // group
    if not desc_act:
        return order.to(torch.int32)
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = order  # the i-th row in act order belongs to group i // group
    return g_idx.to(torch.int32)


def _gptq_params(x: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ ``Quantizer.find_params`` for the rows of ``x`` [N, n]: (scale, zero) [N]."""
    maxq = 2**bits - 1
    xmin = torch.minimum(x.min(1).values, torch.zeros(x.shape[0]))
    xmax = torch.maximum(x.max(1).values, torch.zeros(x.shape[0]))
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both = (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(both, -1.0, xmin), torch.where(both, 1.0, xmax)
    scale = (xmax - xmin) / maxq
    if sym:
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:  # v1 cannot store a zero point of 0 (it stores zero - 1): keep it >= 1
        zero = torch.round(-xmin / scale).clamp(1, maxq)
    return scale, zero


def _pack_along(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """AutoGPTQ's packing: ``32 // bits`` codes per int32 along ``dim``, in order."""
    per = 32 // bits
    codes = codes.to(torch.int64).movedim(dim, 0)
    words = torch.zeros((codes.shape[0] // per, *codes.shape[1:]), dtype=torch.int64)
    for i in range(words.shape[0]):
        for j in range(per):
            words[i] |= codes[i * per + j] << (bits * j)
    # int32 storage of the uint32 bit pattern (as numpy's astype(int32) of AutoGPTQ)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).movedim(0, dim).contiguous()


def gptq_quantize(w: torch.Tensor, spec: GPTQSpec, g_idx: torch.Tensor) -> Quantized:
    n = w.shape[0]
    maxq = 2**spec.bits - 1
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n)
    for g in range(groups):
        scales[g], zeros[g] = _gptq_params(w[:, g_idx == g], spec.bits, spec.sym)
    s_rows, z_rows = scales[g_idx.long()].t(), zeros[g_idx.long()].t()  # [N, K]
    codes = torch.clamp(torch.round(w / s_rows) + z_rows, 0, maxq)
    scales16 = scales.to(torch.float16)
    deq = (codes - z_rows) * scales16.float()[g_idx.long()].t()
    stored_zeros = zeros - 1 if spec.checkpoint_format == "gptq" else zeros
    tensors = {
        "qweight": _pack_along(codes.t(), spec.bits, 0),  # [K * bits / 32, N]
        "qzeros": _pack_along(stored_zeros, spec.bits, 1),  # [G, N * bits / 32]
        "scales": scales16,
        "g_idx": g_idx.clone(),
    }
    if spec.zero_biases:
        tensors["bias"] = torch.zeros(n, dtype=torch.float16)
    return Quantized(tensors, deq)


def write_gptq(src: Path, out: Path, spec: GPTQSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Quantize every decoder linear of the HF model in ``src`` into ``out`` (GPTQ)."""
    gen = torch.Generator().manual_seed(seed)
    perms: dict[str, torch.Tensor] = {}

    def quantize(name: str, w: torch.Tensor) -> Quantized:
        module, proj, _ = _split(name)
        key = module.replace(proj, SAME_INPUT.get(proj, proj))
        if key not in perms:
            group = spec.group_size if spec.group_size != -1 else w.shape[1]
            perms[key] = gptq_g_idx(w.shape[1], group, spec.desc_act, gen)
        return gptq_quantize(w, spec, perms[key])

    config = {
        "bits": spec.bits,
        "group_size": spec.group_size,
        "damp_percent": 0.01,
        "desc_act": spec.desc_act,
        "static_groups": False,
        "sym": spec.sym,
        "true_sequential": True,
        "model_name_or_path": None,
        "model_file_base_name": "model",
        "quant_method": "gptq",
        "checkpoint_format": spec.checkpoint_format,
    }
    return _write(src, out, quantize, config)


# ----------------------------------------------------------------------------- AWQ
def _awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ ``WQLinear_GEMM`` packing of int4 ``codes`` [R, N] -> int32 [R, N / 8]."""
    packed = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for col in range(codes.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= codes[:, col * 8 + AWQ_ORDER[i]].to(torch.int64) << (i * 4)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def awq_quantize(w: torch.Tensor, group_size: int) -> Quantized:
    """AutoAWQ ``pseudo_quantize_tensor`` (4-bit, zero point) and GEMM packing."""
    n, k = w.shape
    group = k if group_size == -1 else group_size
    g = w.reshape(-1, group)
    max_val, min_val = g.amax(dim=1, keepdim=True), g.amin(dim=1, keepdim=True)
    scales = (max_val - min_val).clamp(min=1e-5) / 15
    zeros = (-torch.round(min_val / scales)).clamp_(0, 15)
    codes = torch.clamp(torch.round(g / scales) + zeros, 0, 15)
    scales16 = scales.to(torch.float16)
    deq = ((codes - zeros) * scales16.float()).reshape(n, k)
    scales_gn = scales16.reshape(n, -1).t().contiguous()  # [G, N]
    zeros_gn = zeros.reshape(n, -1).t().contiguous()
    tensors = {
        "qweight": _awq_pack(codes.reshape(n, k).t()),  # [K, N / 8]
        "qzeros": _awq_pack(zeros_gn),  # [G, N / 8]
        "scales": scales_gn,
    }
    return Quantized(tensors, deq)


def write_awq(src: Path, out: Path, group_size: int = 128) -> dict[str, torch.Tensor]:
    """Quantize every decoder linear of the HF model in ``src`` into ``out`` (AWQ GEMM)."""
    config = {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group_size,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    return _write(src, out, lambda _, w: awq_quantize(w, group_size), config)


# ----------------------------------------------------------------------------- int8
def int8_reference(src: Path) -> dict[str, torch.Tensor]:
    """The checkpoint with every decoder linear int8-quantized per output channel and
    de-quantized again (the rest unchanged)."""
    state = load_file(str(src / "model.safetensors"))
    out = {}
    for name, w in state.items():
        if is_linear(name):
            scale = w.float().abs().amax(dim=1, keepdim=True) / 127
            codes = torch.round(w.float() / torch.where(scale > 0, scale, 1.0)).clamp(-127, 127)
            out[name] = codes * scale
        else:
            out[name] = w.float()
    return out


E4M3_MAX = 448.0


# ----------------------------------------------------------------------------- fp8
def e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round ``w / scale`` to e4m3 (torch's round-to-nearest-even cast, as the tools do)."""
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def write_fp8(src: Path, out: Path, fmt: str) -> dict[str, torch.Tensor]:
    """``fmt``: ``ct-tensor`` / ``ct-channel`` (compressed-tensors) or ``hf-tensor`` (AutoFP8 /
    HF fp8). Returns the de-quantized float32 state (HF names)."""
    state = load_file(str(src / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for i, (name, w) in enumerate(sorted(state.items())):
        if not is_linear(name):
            tensors[name] = w.to(torch.float16)
            deq[name] = tensors[name].float()
            continue
        w = w.float() * (1.0 + 0.25 * (i % 5))  # distinct scales for every fused shard
        if fmt == "ct-channel":
            scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).to(torch.float16)  # [N, 1]
        elif fmt == "ct-tensor":
            scale = (w.abs().amax() / E4M3_MAX).reshape(1).to(torch.float16)  # [1]
        else:
            scale = (w.abs().amax() / E4M3_MAX).reshape(())  # [] float32
        codes = e4m3(w, scale.float())
        tensors[name] = codes
        tensors[name.replace(".weight", ".weight_scale")] = scale
        deq[name] = codes.float() * scale.float()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "float16"
    config["quantization_config"] = _fp8_quant_config(fmt)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(src / "generation_config.json", out / "generation_config.json")
    return deq


def _fp8_quant_config(fmt: str) -> dict[str, Any]:
    if fmt == "hf-tensor":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}
    weights = {"num_bits": 8, "type": "float", "strategy": fmt.removeprefix("ct-")}
    weights.update(symmetric=True, dynamic=False, group_size=None, observer="minmax")
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    acts.update(symmetric=True, observer=None)
    return {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "group_0": {"weights": weights, "input_activations": acts, "targets": ["Linear"]}
        },
        "ignore": ["lm_head"],
        "format": "float-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
    }


def fp8_online_reference(src: Path) -> dict[str, torch.Tensor]:
    """``--quantization fp8``: per output row ``amax / 448``, e4m3 codes, de-quantized."""
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if is_linear(name):
            scale = (w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
            out[name] = e4m3(w.float(), scale).float() * scale
        else:
            out[name] = w.float()
    return out


# ----------------------------------------------------------------------------- files
def _write(
    src: Path,
    out: Path,
    quantize: Callable[[str, torch.Tensor], Quantized],
    quant_config: dict[str, Any],
) -> dict[str, torch.Tensor]:
    state = load_file(str(src / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if is_linear(name):
            q = quantize(name, w.float())
            module = name.rpartition(".")[0]
            for key, t in q.tensors.items():  # a real bias wins over a zero placeholder
                tensors.setdefault(f"{module}.{key}", t)
            dequantized[name] = q.dequantized
        else:  # biases, norms, embeddings, LM head: float16, as the tools save them
            tensors[name] = w.to(torch.float16)
            dequantized[name] = tensors[name].float()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "float16"
    config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if (src / "generation_config.json").is_file():
        shutil.copy(src / "generation_config.json", out / "generation_config.json")
    return dequantized


def write_hf_reference(src: Path, state: dict[str, torch.Tensor], out: Path) -> Path:
    """An unquantized float32 HF directory holding ``state`` (for ``generate()``)."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if (src / "generation_config.json").is_file():
        shutil.copy(src / "generation_config.json", out / "generation_config.json")
    return out
