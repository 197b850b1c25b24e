"""LLaVA (``LlavaForConditionalGeneration``): a vision tower, a projector and a Llama-style
language model whose placeholder-token embeddings the projected image features replace.

The vision side is transformers' own: the vision tower is ``AutoModel.from_config`` of the
checkpoint's ``vision_config`` (``CLIPVisionModel`` for LLaVA-1.5) and the projector is HF's
``LlavaMultiModalProjector`` (two linears around ``projector_hidden_act``); the feature layer
(``vision_feature_layer``, one index or several concatenated) and the CLS drop of the
``default`` select strategy follow HF's ``get_image_features``. The language model is
``LlamaForCausalLM`` itself (this class subclasses it), so the executor, the KV cache, LoRA
and tensor parallelism see a plain decoder: the vision encoder is held outside the module tree
(``vision``), so the decoder's parameter walks (loading, dummy weights, LoRA's targets, the
weight count) never reach it. Under TP every rank holds the whole encoder (replicated) and
computes the same features.

The executor embeds a step's tokens (``model.embed``), writes image features over the
placeholder rows and passes ``inputs_embeds`` to the forward (``worker.image_embeds``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.layers import QuantConfig
from tokenwire.runtime.models.llama import LlamaForCausalLM
from tokenwire.runtime.models.llava_config import (
    LLAVA,
    hf_llava_config,
    llava_spec,
)
from tokenwire.runtime.models.weights import WeightSource, as_weight_source
from tokenwire.runtime.multimodal import ImageInput

_SINGLE = TPGroup.single()  # immutable: the default group of one
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


class VisionEncoder(nn.Module):
    """HF's vision tower and projector, with HF's feature selection."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        tower_config = hf_config.vision_config
        self.vision_tower = AutoModel.from_config(tower_config)  # type: ignore[no-untyped-call]
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config)
        layer = hf_config.vision_feature_layer
        self.feature_layers: tuple[int, ...] = (layer,) if isinstance(layer, int) else tuple(layer)
        self.drop_cls = hf_config.vision_feature_select_strategy == "default"

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, channels, height, width] -> [images, tokens per image, text hidden]."""
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        selected = [out.hidden_states[i] for i in self.feature_layers]
        if self.drop_cls:
            selected = [hidden[:, 1:] for hidden in selected]
        features: torch.Tensor = self.multi_modal_projector(torch.cat(selected, dim=-1))
        return features


class ImageSpec(Protocol):
    """What the executor reads of a model's multimodal spec (``LlavaSpec``, ``Gemma3MMSpec``)."""

    @property
    def num_image_tokens(self) -> int: ...


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The language model (``LlamaForCausalLM``) plus ``vision`` (held outside the tree).

    The base of the LLaVA-style models: a subclass (``models.gemma3_mm``) brings its own
    encoder (``vision_encoder``) and says whether an image's placeholder rows attend to the
    whole image during prefill (``bidirectional_images``)."""

    # Gemma 3: the rows of one image's placeholder run see each other (HF's token_type_ids
    # mask); LLaVA: plain causal attention.
    bidirectional_images: bool = False
    # Checkpoint names (past a leading "model.") of the vision side's tensors.
    vision_prefixes: tuple[str, ...] = _VISION_PREFIXES

    def __init__(
        self,
        arch: ModelArch,
        spec: ImageSpec,
        hf_config: Any,
        max_position: int,
        dtype: torch.dtype,
        tp: TPGroup = _SINGLE,
        quant: QuantConfig | None = None,
    ) -> None:
        super().__init__(arch, max_position, dtype, tp, quant)
        self.spec = spec
        encoder = self.vision_encoder(hf_config).to(dtype=dtype).eval()
        object.__setattr__(self, "_vision", encoder)  # not a submodule: see the module doc

    @staticmethod
    def vision_encoder(hf_config: Any) -> nn.Module:
        """The vision tower and projector (not yet on the model's dtype)."""
        return VisionEncoder(hf_config)

    @property
    def vision(self) -> nn.Module:
        encoder: nn.Module = self.__dict__["_vision"]
        return encoder

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] (what the forward would start from); a placeholder id
        outside the vocabulary embeds as id 0 (as HF does: its rows are overwritten)."""
        ids = input_ids.masked_fill(input_ids >= self.arch.vocab_size, 0)
        embeds: torch.Tensor = self.model.embed(ids)
        return embeds

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Processed pixels [images, C, H, W] -> features [images, tokens, hidden]."""
        weight = self.model.embed_tokens.weight
        features: torch.Tensor = self.vision(pixel_values.to(weight.device, weight.dtype))
        return features

    def encode_image_inputs(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's features [tokens, hidden]: one vision-tower batch per pixel shape."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, image in enumerate(images):
            groups.setdefault(tuple(image.pixel_values.shape), []).append(i)
        out: list[torch.Tensor] = [torch.empty(0)] * len(images)
        for members in groups.values():
            pixels = np.stack([images[i].pixel_values for i in members])
            features = self.encode_images(torch.from_numpy(pixels))
            for i, row in zip(members, features, strict=True):
                out[i] = row.clone()  # not a view of the batch
        return out

    @property
    def arch_name(self) -> str:
        return LLAVA

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSource]]) -> None:
        """Language-model tensors go to ``LlamaForCausalLM.load_weights`` under its names;
        the vision tower's and projector's into ``vision`` (strict: none missing or extra).
        Both HF layouts load: ``language_model.model.*`` (saved by transformers < 4.52 and
        by ``save_pretrained`` today) and ``model.language_model.*``."""
        vision: dict[str, torch.Tensor] = {}
        super().load_weights(_language_weights(weights, vision, self.vision_prefixes))
        missing, unexpected = self.vision.load_state_dict(vision, strict=False)
        missing = [m for m in missing if not m.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(
                f"{self.arch_name}: vision weights missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}"
            )


def _language_weights(
    weights: Iterable[tuple[str, torch.Tensor | WeightSource]],
    vision: dict[str, torch.Tensor],
    prefixes: tuple[str, ...],
) -> Iterator[tuple[str, torch.Tensor | WeightSource]]:
    """Yield the language model's tensors renamed to ``LlamaForCausalLM``'s names; read the
    vision tensors into ``vision`` (by ``VisionEncoder`` name)."""
    for name, weight in weights:
        short = name.removeprefix("model.") if name.startswith("model.") else name
        if short.startswith(prefixes):
            vision[short] = as_weight_source(weight).read()
        elif short.startswith("language_model.model."):
            yield "model." + short.removeprefix("language_model.model."), weight
        elif short.startswith("language_model.lm_head."):
            yield short.removeprefix("language_model."), weight
        elif name.startswith("model.language_model."):
            yield "model." + name.removeprefix("model.language_model."), weight
        else:  # lm_head.* (new layout), or unknown: the decoder's loader names it
            yield name, weight


def build_llava(
    config: Mapping[str, Any],
    arch: ModelArch,
    device: torch.device,
    dtype: torch.dtype,
    max_position: int,
    tp: TPGroup = _SINGLE,
    quant: QuantConfig | None = None,
) -> LlavaForConditionalGeneration:
    """Allocate a LLaVA model on ``device`` (weights uninitialised until loaded)."""
    arch.check_tensor_parallel(tp.world_size)
    spec, hf_config = llava_spec(config), hf_llava_config(config)
    with torch.device(device):
        model = LlavaForConditionalGeneration(arch, spec, hf_config, max_position, dtype, tp, quant)
    return model.eval()
