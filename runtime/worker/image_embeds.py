"""``ImageEmbeds``: the executor's image inputs and its encoder-output cache.

A request's images arrive with it (``NewRequestData.images``). The scheduler decides which
images each step encodes (``SchedulerOutput.encoder_inputs``, each content hash once) and which
cached features to drop first (``encoder_frees``): its ``core.encoder_cache`` book mirrors the
cache here, keyed by content hash, so an image repeated in a later request (or twice in one)
is encoded once, and features a running prefill still needs are never dropped. A step covering
part of an image's placeholder run writes that part: a chunked prefill may split a run
anywhere (but a bidirectional one, Gemma 3's: ``image_spans``), and each chunk slices the
cached features by position. Steps with no placeholder
rows skip all of this (``step_embeds`` is None and the forward embeds the tokens itself,
eagerly or compiled).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenwire.kernels.attention_metadata import ImageSpans
from tokenwire.runtime.models.llama import LlamaForCausalLM
from tokenwire.runtime.models.llava import LlavaForConditionalGeneration
from tokenwire.runtime.models.qwen_vl import QwenVLForConditionalGeneration
from tokenwire.runtime.multimodal import ImageInput
from tokenwire.runtime.worker.input_batch import StepArrays
from tokenwire.runtime.worker.mrope_inputs import MRopeInputs
from tokenwire.runtime.worker.request_state import CachedRequestState

# (content hash, first batch row, first feature row, rows)
_Write = tuple[str, int, int, int]


@dataclass(frozen=True, slots=True)
class EncoderWork:
    """What one step's encoder did: distinct images encoded and the seconds it took."""

    num_images: int = 0
    seconds: float = 0.0


class ImageEmbeds:
    def __init__(self, model: LlavaForConditionalGeneration, device: torch.device) -> None:
        self.model = model
        self.device = device
        # An M-RoPE model (Qwen-VL): each request's 3D prompt positions.
        self.mrope: MRopeInputs | None = None
        if isinstance(model, QwenVLForConditionalGeneration):
            self.mrope = MRopeInputs(model.qwen_spec.spatial_merge_size)
        self._images: dict[str, tuple[ImageInput, ...]] = {}
        self._cache: dict[str, torch.Tensor] = {}  # content hash -> features [tokens, hidden]
        self.num_encoded_total = 0  # images through the vision tower since startup

    @classmethod
    def for_model(
        cls, model: LlamaForCausalLM, device: torch.device, max_step_tokens: int
    ) -> ImageEmbeds | None:
        """The image inputs of a vision-language model; None for a text model. A model whose
        image runs are computed whole in one step (Gemma 3) needs a step to hold one: a
        ``ValueError`` naming ``--max-num-batched-tokens`` at startup, not a request that
        never runs."""
        if not isinstance(model, LlavaForConditionalGeneration):
            return None
        run = model.spec.num_image_tokens
        if model.bidirectional_images and run > max_step_tokens:
            raise ValueError(
                f"an image's {run} tokens attend to each other and run in one step: "
                f"--max-num-batched-tokens ({max_step_tokens}) must be at least {run}"
            )
        return cls(model, device)

    def __bool__(self) -> bool:
        return bool(self._images)

    @property
    def cached_hashes(self) -> frozenset[str]:
        return frozenset(self._cache)

    @property
    def cached_tokens(self) -> int:
        return sum(int(f.shape[0]) for f in self._cache.values())

    def add(self, request_id: str, images: Sequence[ImageInput], num_prompt_tokens: int) -> None:
        if images:
            self._images[request_id] = tuple(images)
            if self.mrope is not None:
                self.mrope.add(request_id, num_prompt_tokens, images)

    def forget(self, request_id: str) -> None:
        self._images.pop(request_id, None)
        if self.mrope is not None:
            self.mrope.forget(request_id)

    def run_encoder(
        self, encoder_inputs: dict[str, tuple[int, ...]], frees: Sequence[str]
    ) -> EncoderWork:
        """Drop the scheduler's evictions, then encode this step's images into the cache
        (``encode_image_inputs``: LLaVA batches them by pixel shape)."""
        for content_hash in frees:
            self._cache.pop(content_hash, None)
        if not encoder_inputs:
            return EncoderWork()
        t0 = time.perf_counter()
        todo: dict[str, ImageInput] = {}
        for request_id, indices in encoder_inputs.items():
            images = self._images[request_id]
            for index in indices:
                todo.setdefault(images[index].content_hash, images[index])
        pending = list(todo.values())
        for image, features in zip(pending, self.model.encode_image_inputs(pending), strict=True):
            self._cache[image.content_hash] = features
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the time is the encoder's, not queued work
        self.num_encoded_total += len(todo)
        return EncoderWork(len(todo), time.perf_counter() - t0)

    def step_embeds(
        self, states: Sequence[CachedRequestState], arrays: StepArrays
    ) -> torch.Tensor | None:
        """The step's input embeddings [T, hidden] with image features over the placeholder
        rows it computes; None when no row of the step is a placeholder."""
        writes = self._plan(states, arrays)
        if not writes:
            return None
        embeds = self.model.embed_tokens(torch.from_numpy(arrays.input_ids).to(self.device))
        for content_hash, row, first, count in writes:
            features = self._cache[content_hash]  # the scheduler keeps it while needed
            embeds[row : row + count] = features[first : first + count].to(embeds.dtype)
        return embeds

    def step_inputs(
        self, states: Sequence[CachedRequestState], arrays: StepArrays
    ) -> tuple[torch.Tensor | None, ImageSpans, np.ndarray | None]:
        """The step's input embeddings (``step_embeds``), bidirectional runs
        (``image_spans``) and 3D positions [3, T] of an M-RoPE model (else None)."""
        positions = None if self.mrope is None else self.mrope.positions(states, arrays)
        return self.step_embeds(states, arrays), self.image_spans(states, arrays), positions

    def image_spans(self, states: Sequence[CachedRequestState], arrays: StepArrays) -> ImageSpans:
        """(batch sequence, run start, run end) of each bidirectional image run the step
        computes rows of (``AttentionMetadata.image_spans``; Gemma 3), else ()."""
        if not self.model.bidirectional_images:
            return ()
        spans: list[tuple[int, int, int]] = []
        starts = arrays.query_start_loc
        for i, state in enumerate(states):
            lo, hi = int(starts[i]), int(starts[i + 1])
            begin = int(arrays.positions[lo]) if hi > lo else 0
            for image in self._images.get(state.request_id, ()):
                if image.bidirectional and image.offset < begin + hi - lo and begin < image.end:
                    spans.append((i, image.offset, image.end))
        return tuple(spans)

    def _plan(self, states: Sequence[CachedRequestState], arrays: StepArrays) -> list[_Write]:
        writes: list[_Write] = []
        starts = arrays.query_start_loc
        for i, state in enumerate(states):
            images = self._images.get(state.request_id)
            if not images:
                continue
            lo, hi = int(starts[i]), int(starts[i + 1])
            begin = int(arrays.positions[lo])
            end = begin + hi - lo
            for image in images:
                first, last = max(begin, image.offset), min(end, image.end)
                if first < last:
                    writes.append(
                        (image.content_hash, lo + first - begin, first - image.offset, last - first)
                    )
        return writes


def add_images(
    embeds: ImageEmbeds | None,
    request_id: str,
    images: Sequence[ImageInput],
    num_prompt_tokens: int,
) -> None:
    """A new request's images (none: nothing to do); a text model refuses them."""
    if not images:
        return
    if embeds is None:
        raise ValueError(f"request {request_id}: this model takes no image inputs")
    embeds.add(request_id, images, num_prompt_tokens)
