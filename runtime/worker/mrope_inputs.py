"""``MRopeInputs``: the executor's 3D rotary positions of an M-RoPE model (Qwen-VL).

A request's prompt positions and rope delta (``models.mrope.prompt_positions``) are laid out
once, from its images' placeholder runs and patch grids, when it arrives; a text-only request
needs none (its three positions are its text position). Each step's positions [3, T] come
from the step's plain text positions (``StepArrays.positions``) and each row's request: a
prompt position reads the prompt's table, a later one (a decode token, an output recomputed
after preemption, a draft) is ``text position + delta``. So chunked prefill, prefix-cache hits
(a prefill starting mid-prompt), preemption and async scheduling (the worker's own
positions) need nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenwire.runtime.models.mrope import ImageRun, prompt_positions, step_positions
from tokenwire.runtime.multimodal import ImageInput
from tokenwire.runtime.worker.input_batch import StepArrays
from tokenwire.runtime.worker.request_state import CachedRequestState

_TEXT_ONLY: tuple[np.ndarray, int] = (np.empty((3, 0), dtype=np.int64), 0)  # never written


class MRopeInputs:
    def __init__(self, spatial_merge_size: int) -> None:
        self.merge = spatial_merge_size
        self._prompts: dict[str, tuple[np.ndarray, int]] = {}  # request -> (positions, delta)

    def add(self, request_id: str, num_prompt_tokens: int, images: Sequence[ImageInput]) -> None:
        """Lay out a request's prompt positions (a request with images)."""
        runs: list[ImageRun] = []
        for image in images:
            if image.grid_thw is None:
                raise ValueError(f"request {request_id}: an M-RoPE image needs its patch grid")
            t, h, w = image.grid_thw
            runs.append((image.offset, image.length, (t, h // self.merge, w // self.merge)))
        self._prompts[request_id] = prompt_positions(num_prompt_tokens, runs)

    def forget(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)

    def positions(self, states: Sequence[CachedRequestState], arrays: StepArrays) -> np.ndarray:
        """int64 [3, T] positions of the step's rows."""
        prompts = [self._prompts.get(state.request_id, _TEXT_ONLY) for state in states]
        return step_positions(arrays.positions, arrays.query_start_loc, prompts)
