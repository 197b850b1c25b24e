"""``ImageEmbeds``: the executor's image inputs, encoded in the step that first needs them.

A request's images arrive with it (``NewRequestData.images``). The first step whose prompt
rows reach a placeholder run encodes all the request's images at once (one vision-tower
batch) and keeps the features until the step that completes its prompt; a step covering part
of a run writes that part (a chunked prefill may split a run anywhere: each chunk slices the
kept features by position). A request preempted after its prompt completed encodes again when
it recomputes. Steps with no placeholder rows skip all of this (``step_embeds`` is None and the
forward embeds the tokens itself, eagerly or compiled).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tokenwire.runtime.models.llama import LlamaForCausalLM
from tokenwire.runtime.models.llava import LlavaForConditionalGeneration
from tokenwire.runtime.multimodal import ImageInput
from tokenwire.runtime.worker.input_batch import StepArrays
from tokenwire.runtime.worker.request_state import CachedRequestState

# (request id, image index, first batch row, first feature row, rows)
_Write = tuple[str, int, int, int, int]


class ImageEmbeds:
    def __init__(self, model: LlavaForConditionalGeneration, device: torch.device) -> None:
        self.model = model
        self.device = device
        self._images: dict[str, tuple[ImageInput, ...]] = {}
        self._features: dict[str, torch.Tensor] = {}  # [images, tokens, hidden]

    @classmethod
    def for_model(cls, model: LlamaForCausalLM, device: torch.device) -> ImageEmbeds | None:
        """The image inputs of a vision-language model; None for a text model."""
        if isinstance(model, LlavaForConditionalGeneration):
            return cls(model, device)
        return None

    def __bool__(self) -> bool:
        return bool(self._images)

    def add(self, request_id: str, images: Sequence[ImageInput]) -> None:
        if images:
            self._images[request_id] = tuple(images)

    def forget(self, request_id: str) -> None:
        self._images.pop(request_id, None)
        self._features.pop(request_id, None)

    def step_embeds(
        self, states: Sequence[CachedRequestState], arrays: StepArrays
    ) -> torch.Tensor | None:
        """The step's input embeddings [T, hidden] with image features over the placeholder
        rows it computes; None when no row of the step is a placeholder."""
        writes, done = self._plan(states, arrays)
        if not writes:
            return None
        embeds = self.model.embed_tokens(torch.from_numpy(arrays.input_ids).to(self.device))
        for request_id, index, row, first, count in writes:
            features = self._encoded(request_id)
            embeds[row : row + count] = features[index, first : first + count].to(embeds.dtype)
        for request_id in done:  # its prompt completes in this step
            self._features.pop(request_id, None)
        return embeds

    def _plan(
        self, states: Sequence[CachedRequestState], arrays: StepArrays
    ) -> tuple[list[_Write], list[str]]:
        writes: list[_Write] = []
        done: list[str] = []
        starts = arrays.query_start_loc
        for i, state in enumerate(states):
            images = self._images.get(state.request_id)
            if not images:
                continue
            lo, hi = int(starts[i]), int(starts[i + 1])
            begin = int(arrays.positions[lo])
            end = begin + hi - lo
            for index, image in enumerate(images):
                first, last = max(begin, image.offset), min(end, image.end)
                if first < last:
                    row = lo + first - begin
                    writes.append(
                        (state.request_id, index, row, first - image.offset, last - first)
                    )
            if end >= len(state.prompt_token_ids):
                done.append(state.request_id)
        return writes, done

    def _encoded(self, request_id: str) -> torch.Tensor:
        features = self._features.get(request_id)
        if features is None:
            pixels = np.stack([image.pixel_values for image in self._images[request_id]])
            features = self.model.encode_images(torch.from_numpy(pixels))
            self._features[request_id] = features
        return features


def add_images(embeds: ImageEmbeds | None, request_id: str, images: Sequence[ImageInput]) -> None:
    """A new request's images (none: nothing to do); a text model refuses them."""
    if not images:
        return
    if embeds is None:
        raise ValueError(f"request {request_id}: this model takes no image inputs")
    embeds.add(request_id, images)
