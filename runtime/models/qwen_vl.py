"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``): a dynamic-resolution vision transformer whose merged
patch features replace the ``<|image_pad|>`` run of each image, and a Qwen2 language model
rotated with M-RoPE (``models.mrope``).

The vision side is transformers' own module (``visual``:
``Qwen2_5_VisionTransformerPretrainedModel`` with its window attention, 2D rotary and patch
merger, or Qwen2-VL's ``Qwen2VisionTransformerPretrainedModel``), run over the concatenated
patches of a step's images with their ``grid_thw`` and split per image, as HF's
``get_image_features``. Everything else (the encoder held outside the module tree, both
checkpoint layouts, the encoder replicated under TP) is the LLaVA base's (``models.llava``).

The forward takes 3D positions [3, T] (the executor's ``worker.mrope_inputs``): each layer
rotates with the step's gathered rotary rows (``mrope_table``) at positions ``0..T-1``. The
rows of an image's run attend causally (as in HF), so a chunked prefill may split a run:
each chunk takes its slice of the cached features and of the prompt's positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.decoder import KVCache
from tokenwire.runtime.models.layers import QuantConfig
from tokenwire.runtime.models.llava import LlavaForConditionalGeneration
from tokenwire.runtime.models.mrope import mrope_table
from tokenwire.runtime.models.qwen_vl_config import (
    QwenVLSpec,
    hf_qwen_vl_config,
    qwen_vl_spec,
)
from tokenwire.runtime.multimodal import ImageInput

_SINGLE = TPGroup.single()  # immutable: the default group of one


class QwenVisionEncoder(nn.Module):
    """HF's vision transformer under the checkpoint's name (``visual``)."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
        from transformers.models.qwen2_vl import modeling_qwen2_vl

        tower: Any = modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel
        if hf_config.model_type == "qwen2_5_vl":
            tower = modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel
        self.visual = tower._from_config(hf_config.vision_config)
        self.merge = int(hf_config.vision_config.spatial_merge_size)

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Concatenated patches [patches, features] of images of ``grid_thw`` [images, 3] ->
        each image's merged features [tokens, text hidden]."""
        out = self.visual(patches, grid_thw=grid_thw, return_dict=True)
        sizes = (grid_thw.prod(-1) // self.merge**2).tolist()
        return list(torch.split(out.pooler_output, sizes))


class QwenVLForConditionalGeneration(LlavaForConditionalGeneration):
    vision_prefixes = ("visual.",)

    @staticmethod
    def vision_encoder(hf_config: Any) -> nn.Module:
        return QwenVisionEncoder(hf_config)

    @property
    def qwen_spec(self) -> QwenVLSpec:
        spec = self.spec
        assert isinstance(spec, QwenVLSpec)
        return spec

    @property
    def arch_name(self) -> str:
        return self.qwen_spec.architecture

    def encode_image_inputs(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's features [tokens, hidden], all images in one vision-tower call."""
        grids = [image.grid_thw for image in images]
        if any(grid is None for grid in grids):
            raise ValueError(f"{self.arch_name}: an image without its patch grid")
        weight = self.model.embed_tokens.weight
        patches = torch.from_numpy(np.concatenate([image.pixel_values for image in images]))
        grid_thw = torch.tensor(grids, dtype=torch.long, device=weight.device)
        pixels = patches.to(weight.device, weight.dtype)
        features: list[torch.Tensor] = self.vision(pixels, grid_thw)
        return [f.clone() for f in features]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache | None],
        meta: AttentionMetadata | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``; ``positions`` [3, T] rotate with M-RoPE."""
        if positions.dim() == 1:
            return super().forward(input_ids, positions, kv_caches, meta, inputs_embeds)
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV caches, got {len(kv_caches)}")
        table = mrope_table(self.cos_sin_cache, positions, self.qwen_spec.mrope_section)
        rows = torch.arange(positions.shape[1], device=positions.device)
        hidden = self.model.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(rows, hidden, residual, kv_cache, meta, table)
        if residual is None:  # zero-layer model
            residual = torch.zeros_like(hidden)
        normed, _ = self.model.norm.add_and_norm(hidden, residual)
        return normed


def build_qwen_vl(
    config: Mapping[str, Any],
    arch: ModelArch,
    device: torch.device,
    dtype: torch.dtype,
    max_position: int,
    tp: TPGroup = _SINGLE,
    quant: QuantConfig | None = None,
) -> QwenVLForConditionalGeneration:
    """Allocate a Qwen-VL model on ``device`` (weights uninitialised until loaded)."""
    arch.check_tensor_parallel(tp.world_size)
    spec, hf_config = qwen_vl_spec(config), hf_qwen_vl_config(config)
    with torch.device(device):
        model = QwenVLForConditionalGeneration(
            arch, spec, hf_config, max_position, dtype, tp, quant
        )
    return model.eval()
