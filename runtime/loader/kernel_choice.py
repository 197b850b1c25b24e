"""Which kernels a loaded model's weights run on, decided from the ``ModelConfig`` flags, the
device and the checkpoint: whether a GGUF file's linears stay quantized (and on which CPU
kernel: ``kernels.vnni_matmul`` or torch's bf16 int4), the CPU LM head's copy
(``--lm-head-dtype``) and the fused CPU decoder stack (``--cpu-fused-layers``).
``model_loader.load_model`` calls them while it builds the model.
"""

from __future__ import annotations

import logging

import torch

from tokenwire.kernels.vnni_matmul import vnni_status
from tokenwire.runtime.config import CpuQuantKernel, ModelConfig
from tokenwire.runtime.loader.source import ModelSource
from tokenwire.runtime.models.layers.quant.base import QuantConfig
from tokenwire.runtime.models.layers.quant.gguf import GROUP, GGUFConfig, gguf_linear_plan
from tokenwire.runtime.models.llama import LlamaForCausalLM, LogitsKind

_log = logging.getLogger(__name__)


def gguf_plan(
    model_config: ModelConfig, source: ModelSource, device: torch.device, dtype: torch.dtype
) -> tuple[QuantConfig | None, torch.dtype] | None:
    """(scheme, model dtype) for a GGUF source; None: not a GGUF question (resolve as usual).

    Kept quantized: ``--quantization gguf`` (the linears compute in the model dtype; float32
    runs an exact dequantized copy; layers the plan cannot keep run float), or by default on
    CPU with ``--dtype auto`` for a file whose every linear is int4, or whose every linear is
    kept (K-quants such as Q4_K_M, Q8_0) where the VNNI kernel runs: a float32 model whose
    linears run that kernel or torch's bf16 int4 kernel (activations cast per call). A file with no
    kept-quantized layer loads de-quantized."""
    flag = model_config.quantization
    if source.gguf is None or flag not in (None, "gguf") or model_config.load_format == "dummy":
        return None
    auto_cpu = model_config.dtype == "auto" and device.type == "cpu"
    if flag is None and not auto_cpu:
        return None
    plan, why = gguf_linear_plan(source.gguf)
    schemes = {scheme for _, scheme in plan}
    all_int4 = schemes == {("int4", GROUP)}
    # By default (dtype auto on CPU) a file is kept quantized when every linear is int4, or
    # every linear is kept (K-quants, Q8_0) and the VNNI kernel runs them.
    kept = auto_cpu and None not in schemes
    fast = all_int4 or (kept and _use_vnni(model_config.cpu_quant_kernel))
    if not any(schemes) or (flag is None and not fast):
        if flag == "gguf":
            _log.warning("%s: linear weights de-quantized to float: %s", source.gguf.name, why)
        return (None, dtype) if flag == "gguf" else None
    if why:
        _log.warning("%s: %s", source.gguf.name, why)
    if auto_cpu:  # float32 model, int4 linears on the VNNI or torch's bf16 int4 kernel
        vnni = _use_vnni(model_config.cpu_quant_kernel)
        return GGUFConfig("int4", compute_dtype=torch.bfloat16, plan=plan, vnni=vnni), dtype
    return GGUFConfig(plan=plan), dtype


def _use_vnni(kernel: CpuQuantKernel) -> bool:
    """``--cpu-quant-kernel``: whether the GGUF's int4 linears run ``kernels.vnni_matmul``."""
    if kernel == "torch":
        return False
    status = vnni_status()
    if not status.loaded:
        if kernel == "vnni":
            raise ValueError(f"cpu_quant_kernel vnni: unavailable: {status.reason}")
        _log.info("CPU int4 linears run torch's int4 kernel: the VNNI kernel is unavailable: %s",
                  status.reason)  # fmt: skip
    return status.loaded


def prepare_fused_stack(model: LlamaForCausalLM, quant: QuantConfig | None) -> None:
    """``--cpu-fused-layers``: the decoder stack as one operator where the model allows it."""
    reason = model.prepare_fused_stack()
    if reason is None:
        _log.info("CPU decoder layers run as one fused operator (--cpu-fused-layers)")
    elif isinstance(quant, GGUFConfig) and quant.vnni:
        _log.info("CPU decoder layers run as torch ops: fused layers do not cover %s", reason)


def lm_head_kind(
    model_config: ModelConfig, quant: QuantConfig | None, device: torch.device
) -> LogitsKind:
    """``--lm-head-dtype``: the CPU LM head's copy (``bf16_logits`` / ``int8_logits``);
    auto: int8 or bf16 only for a GGUF kept quantized on the fast kernels (the default model
    on CPU): int8 where its linears run the VNNI kernel."""
    chosen = model_config.lm_head_dtype
    if device.type != "cpu":
        return "float32"
    if chosen == "int8" and not vnni_status().loaded:
        raise ValueError(f"lm_head_dtype int8: unavailable: {vnni_status().reason}")
    if chosen != "auto":
        return chosen
    if not isinstance(quant, GGUFConfig) or quant.compute_dtype != torch.bfloat16:
        return "float32"
    return "int8" if quant.vnni else "bfloat16"
