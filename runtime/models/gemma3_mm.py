"""Gemma 3 multimodal (``Gemma3ForConditionalGeneration``): a SigLIP vision tower, Gemma 3's
projector (average pooling to ``mm_tokens_per_image``, a soft-embedding RMS norm, one
matrix) and the Gemma 3 text model, whose image-token embeddings the projected features
replace.

The vision side is transformers' own: ``AutoModel.from_config`` of ``vision_config``
(``SiglipVisionModel``) and HF's ``Gemma3MultiModalProjector`` over the tower's last hidden
state, as HF's ``get_image_features``. The language model is tokenwire's Gemma 3 text
decoder (``LlamaForCausalLM`` with Gemma 3's ``ModelArch``); everything else (the encoder held
outside the module tree, the weight layouts, TP with the encoder replicated) is the LLaVA
base's (``models.llava``).

Unlike LLaVA, HF's Gemma 3 attends bidirectionally within each image during prefill (the
``token_type_ids`` mask: full layers OR(causal, same image), sliding layers AND(window,
OR(causal, same image))): ``bidirectional_images`` makes the executor hand each step's image
runs to the attention (``AttentionMetadata.image_spans``, ``kernels.image_attention``), and
the front marks the images so a chunked prefill never splits a run (``ImageInput``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.gemma3_mm_config import (
    GEMMA3_MM,
    gemma3_mm_spec,
    hf_gemma3_config,
)
from tokenwire.runtime.models.layers import QuantConfig
from tokenwire.runtime.models.llava import LlavaForConditionalGeneration

_SINGLE = TPGroup.single()  # immutable: the default group of one


class Gemma3VisionEncoder(nn.Module):
    """HF's SigLIP tower and Gemma 3 projector (``vision_tower``, ``multi_modal_projector``:
    the checkpoint's names)."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        self.vision_tower = AutoModel.from_config(hf_config.vision_config)  # type: ignore[no-untyped-call]
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, channels, height, width] -> [images, mm_tokens_per_image, text hidden]."""
        out = self.vision_tower(pixel_values=pixel_values, return_dict=True)
        features: torch.Tensor = self.multi_modal_projector(out.last_hidden_state)
        return features


class Gemma3ForConditionalGeneration(LlavaForConditionalGeneration):
    bidirectional_images = True

    @staticmethod
    def vision_encoder(hf_config: Any) -> nn.Module:
        return Gemma3VisionEncoder(hf_config)

    @property
    def arch_name(self) -> str:
        return GEMMA3_MM


def build_gemma3_mm(
    config: Mapping[str, Any],
    arch: ModelArch,
    device: torch.device,
    dtype: torch.dtype,
    max_position: int,
    tp: TPGroup = _SINGLE,
    quant: QuantConfig | None = None,
) -> Gemma3ForConditionalGeneration:
    """Allocate a Gemma 3 multimodal model on ``device`` (weights uninitialised until loaded)."""
    arch.check_tensor_parallel(tp.world_size)
    spec, hf_config = gemma3_mm_spec(config), hf_gemma3_config(config)
    with torch.device(device):
        model = Gemma3ForConditionalGeneration(
            arch, spec, hf_config, max_position, dtype, tp, quant
        )
    return model.eval()
