"""M-RoPE positions (``runtime.models.mrope``) against transformers' own: a prompt's 3D
positions and rope delta equal ``Qwen2_5_VLModel.get_rope_index`` for images at the start,
in the middle and at the end, of square and non-square grids; a step's
positions slice the prompt's table (any chunk) and continue as text position + delta past
it; the gathered rotary rows equal HF's ``Qwen2_5_VLRotaryEmbedding`` cos and sin."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tiny_qwen_vl import IMAGE_TOKEN, VISION_END, VISION_START
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

from tokenwire.kernels.rotary import build_cos_sin_cache, compute_inv_freq
from tokenwire.runtime.models.mrope import mrope_table, prompt_positions, step_positions
from tokenwire.runtime.models.qwen_vl_config import qwen_vl_spec

MERGE = 2
SECTION = (2, 3, 3)
# (text tokens before the image, merged (h, w)) per image, then trailing text tokens.
LAYOUTS = [
    ([(3, (2, 3)), (2, (3, 1))], 4),
    ([(0, (2, 2)), (1, (1, 4))], 0),  # an image first, one last
    ([(5, (4, 4))], 1),
]


def _hf_model() -> Qwen2_5_VLModel:
    text = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "mrope_section": list(SECTION),
                            "rope_theta": 10000.0},
    }  # fmt: skip
    vision = {"depth": 1, "hidden_size": 16, "num_heads": 2, "out_hidden_size": 64}
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
    )  # fmt: skip
    return Qwen2_5_VLModel(config).eval()


def _layout(images: list[tuple[int, tuple[int, int]]], tail: int) -> tuple[list[int], list[Any]]:
    ids: list[int] = []
    runs = []
    for text, (h, w) in images:
        ids.extend([7] * text)
        runs.append((len(ids), h * w, (1, h, w)))
        ids.extend([IMAGE_TOKEN] * (h * w))
    ids.extend([7] * tail)
    return ids, runs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prompt_positions_equal_hf_get_rope_index(layout: Any) -> None:
    ids, runs = _layout(*layout)
    model = _hf_model()
    input_ids = torch.tensor([ids])
    grids = torch.tensor([[t, h * MERGE, w * MERGE] for _, _, (t, h, w) in runs])
    want, delta = model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == IMAGE_TOKEN).int(), image_grid_thw=grids
    )
    got, got_delta = prompt_positions(len(ids), runs)
    assert np.array_equal(got, want[:, 0].numpy())
    assert got_delta == int(delta)


def test_step_positions_slice_the_prompt_and_add_the_delta() -> None:
    ids, runs = _layout(*LAYOUTS[0])
    table, delta = prompt_positions(len(ids), runs)
    n = len(ids)
    # Row 0: a chunk from mid-image to 3 tokens past the prompt; row 1: a text-only decode.
    text = np.array([*range(4, n + 3), 9], dtype=np.int64)
    starts = np.array([0, n - 1, n], dtype=np.int64)
    got = step_positions(text, starts, [(table, delta), (np.empty((3, 0), np.int64), 0)])
    past = np.arange(n, n + 3) + delta
    assert np.array_equal(got[:, : n - 4], table[:, 4:])
    assert np.array_equal(got[:, n - 4 : n - 1], np.broadcast_to(past, (3, 3)))
    assert got[:, -1].tolist() == [9, 9, 9]


def test_mrope_table_equals_hf_rotary() -> None:
    ids, runs = _layout(*LAYOUTS[0])
    positions, _ = prompt_positions(len(ids), runs)
    model = _hf_model()
    rotary = Qwen2_5_VLRotaryEmbedding(model.config.text_config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, torch.from_numpy(positions)[:, None, :])
    head_dim = 16
    cache = build_cos_sin_cache(compute_inv_freq(head_dim, 10000.0, None), 64, torch.float32, 1.0)
    table = mrope_table(cache, torch.from_numpy(positions), SECTION)
    half = head_dim // 2
    assert torch.equal(table[:, :half], cos[0, :, :half])
    assert torch.equal(table[:, half:], sin[0, :, :half])


@pytest.mark.parametrize("section", [[2, 3, 4], [1, 3, 3]])
def test_a_mrope_section_that_does_not_cover_the_head_is_a_startup_error(
    section: list[int],
) -> None:
    """head_dim 16 needs sections summing to 8 (one frequency per feature pair); any other sum
    is refused when the model is built, naming the field, not at the first image request."""
    text = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "mrope_section": section},
    }  # fmt: skip
    config = Qwen2_5_VLConfig(text_config=text, vision_config={"depth": 1}).to_dict()
    config["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    with pytest.raises(ValueError, match=r"mrope_section .* head_dim / 2 = 8"):
        qwen_vl_spec(config)
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    good = Qwen2_5_VLConfig(text_config=text, vision_config={"depth": 1}).to_dict()
    good["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    assert qwen_vl_spec(good).mrope_section == (2, 3, 3)
