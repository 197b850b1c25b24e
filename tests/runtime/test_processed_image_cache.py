"""The front's processed-image cache (``front/processed_images.py``) with real image
processors (a tiny Qwen2.5-VL's, LLaVA's and Gemma 3's, each with SmolLM2's tokenizer and chat
template): a session's second turn re-renders the first turn's image without decoding or
processing it, and its ids and ``ImageInput``s equal, bit for bit, a render without the cache;
the byte budget holds; a budget of 0 keeps nothing; several threads rendering the same images
at once all get a miss's result."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tiny_gemma3_mm import save_tiny_gemma3_mm
from tiny_llava import save_tiny_llava, synthetic_image
from tiny_qwen_vl import save_tiny_qwen_vl

from tokenwire.runtime.front.chat_images import render_chat_images
from tokenwire.runtime.front.images import ImagePrompter
from tokenwire.runtime.front.processed_images import (
    ENTRY_OVERHEAD_BYTES,
    ProcessedImage,
    ProcessedImageCache,
    image_key,
)
from tokenwire.runtime.front.tokenizer import Tokenizer, load_tokenizer
from tokenwire.runtime.multimodal import ImageInput

IMAGE, START, END, VIDEO = 4, 5, 6, 7  # SmolLM2 special tokens no template produces
MAX_PIXELS = 100_000
Rendered = tuple[list[int], tuple[ImageInput, ...]]


class CountingProcessor:
    """The model's real image processor, its calls and images counted."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.calls = 0
        self.images = 0
        self._lock = threading.Lock()

    def __call__(self, *, images: list[Any], **kwargs: Any) -> Any:
        with self._lock:
            self.calls += 1
            self.images += len(images)
        return self.processor(images=images, **kwargs)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "llava", "gemma3"])
def model_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any
) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llava":
        save_tiny_llava(path, len(smollm_tokenizer), IMAGE, max_position=512)
    elif request.param == "gemma3":
        save_tiny_gemma3_mm(path, len(smollm_tokenizer), 512, (IMAGE, START, END))
    else:
        save_tiny_qwen_vl(path, vocab_size=len(smollm_tokenizer), tokens=(IMAGE, START, END, VIDEO))
    smollm_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return load_tokenizer(str(model_dir))


def _prompter(model_dir: Path) -> tuple[ImagePrompter, CountingProcessor]:
    real = ImagePrompter.from_model_dir(model_dir)
    assert real is not None
    counter = CountingProcessor(real.processor)
    return ImagePrompter(real.spec, counter), counter


def _png(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    out = io.BytesIO()
    synthetic_image(seed, size).save(out, format="PNG")
    return out.getvalue()


def _user(text: str, *images: bytes) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image", "data": data, "part": f"p{i}"} for i, data in enumerate(images)]
    return {"role": "user", "content": parts}


def _session(turns: int) -> list[list[dict[str, Any]]]:
    """The transcript each turn of a session renders: turn k adds one image (sizes differ,
    so Qwen-VL's runs and grids differ) and keeps every earlier one."""
    out: list[list[dict[str, Any]]] = []
    messages: list[dict[str, Any]] = []
    for k in range(turns):
        messages = [*messages, _user(f"Turn {k}: ", _png(k, (40 + 8 * k, 48)))]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"Reply {k}."}]
    return out


def _render(
    tokenizer: Tokenizer,
    prompter: ImagePrompter,
    messages: Sequence[Mapping[str, Any]],
    cache: ProcessedImageCache | None,
) -> Rendered:
    return render_chat_images(
        tokenizer, prompter, messages, None, max_pixels=MAX_PIXELS, cache=cache
    )


def _assert_bit_equal(got: Rendered, want: Rendered) -> None:
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1])
    for a, b in zip(got[1], want[1], strict=True):
        assert (a.offset, a.length, a.content_hash) == (b.offset, b.length, b.content_hash)
        assert (a.bidirectional, a.grid_thw) == (b.bidirectional, b.grid_thw)
        assert a.pixel_values.dtype == b.pixel_values.dtype
        assert a.pixel_values.shape == b.pixel_values.shape
        assert a.pixel_values.tobytes() == b.pixel_values.tobytes()


def test_later_turns_process_only_their_new_image(model_dir: Path, tokenizer: Tokenizer) -> None:
    turns = _session(3)
    off_prompter, off_counter = _prompter(model_dir)
    off = [_render(tokenizer, off_prompter, t, None) for t in turns]
    assert (off_counter.calls, off_counter.images) == (3, 1 + 2 + 3)  # every image, every turn
    prompter, counter = _prompter(model_dir)
    cache = ProcessedImageCache()
    on: list[Rendered] = []
    for k, messages in enumerate(turns):
        on.append(_render(tokenizer, prompter, messages, cache))
        assert (counter.calls, counter.images) == (k + 1, k + 1)  # only the turn's new image
        _assert_bit_equal(on[k], off[k])
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (0 + 1 + 2, 3, 3)
    # A turn that only re-reads the transcript (no new image) processes nothing at all.
    again = [*turns[-1], {"role": "assistant", "content": "R."}, _user("And?")]
    _assert_bit_equal(
        _render(tokenizer, prompter, again, cache), _render(tokenizer, off_prompter, again, None)
    )
    assert counter.calls == 3


def test_zero_budget_keeps_nothing(model_dir: Path, tokenizer: Tokenizer) -> None:
    turns = _session(2)
    prompter, counter = _prompter(model_dir)
    cache = ProcessedImageCache(0)
    off_prompter, _ = _prompter(model_dir)
    for messages in turns:
        _assert_bit_equal(
            _render(tokenizer, prompter, messages, cache),
            _render(tokenizer, off_prompter, messages, None),
        )
    assert (counter.calls, counter.images) == (2, 1 + 2)
    assert cache.stats() == type(cache.stats())(0, 0, 0, 0)  # not even looked up


def test_the_byte_budget_holds_and_evicts_the_least_recently_used(
    model_dir: Path, tokenizer: Tokenizer
) -> None:
    prompter, counter = _prompter(model_dir)
    probe = ProcessedImageCache()
    _render(tokenizer, prompter, [_user("x", _png(0))], probe)
    one = probe.stats().bytes  # every image here is 40 x 48: the same size
    assert one > ENTRY_OVERHEAD_BYTES
    cache = ProcessedImageCache(2 * one + one // 2)  # room for two
    for seed in (1, 2, 3):
        _render(tokenizer, prompter, [_user("x", _png(seed))], cache)
        assert cache.stats().bytes <= cache.max_bytes
    assert (cache.stats().entries, cache.stats().bytes) == (2, 2 * one)
    before = counter.images
    _render(tokenizer, prompter, [_user("x", _png(3), _png(2))], cache)  # both kept: no work
    assert counter.images == before
    _render(tokenizer, prompter, [_user("x", _png(1))], cache)  # evicted first: processed
    assert counter.images == before + 1
    # Image 1 came back in and pushed out the least recently used one, image 3.
    _render(tokenizer, prompter, [_user("x", _png(2), _png(1))], cache)
    assert counter.images == before + 1
    _render(tokenizer, prompter, [_user("x", _png(3))], cache)
    assert counter.images == before + 2
    assert cache.stats().bytes <= cache.max_bytes


def test_an_image_over_the_whole_budget_is_not_kept() -> None:
    cache = ProcessedImageCache(4096)
    big = ProcessedImage(np.zeros(1024, np.float32), None, "h")  # 4096 + overhead
    small = ProcessedImage(np.zeros(16, np.float32), None, "s")
    cache.put(b"small", small)
    cache.put(b"big", big)
    assert cache.get(b"big") is None and cache.get(b"small") is small
    assert cache.stats().bytes == small.nbytes <= cache.max_bytes
    with pytest.raises(ValueError, match="--mm-processor-cache-bytes"):
        ProcessedImageCache(-1)


def test_the_key_is_the_bytes_and_the_pixel_limit() -> None:
    png = _png(0)
    assert image_key(png, MAX_PIXELS) == image_key(bytes(png), MAX_PIXELS)
    assert image_key(png, MAX_PIXELS) != image_key(png, MAX_PIXELS - 1)
    assert image_key(png, MAX_PIXELS) != image_key(_png(1), MAX_PIXELS)


def test_concurrent_renders_of_the_same_images(model_dir: Path, tokenizer: Tokenizer) -> None:
    """Eight threads, each rendering the same three transcripts at once through one cache:
    every result equals a cache-off render, and the cache ends with the three images."""
    turns = _session(3)
    off_prompter, _ = _prompter(model_dir)
    want = [_render(tokenizer, off_prompter, t, None) for t in turns]
    prompter, counter = _prompter(model_dir)
    cache = ProcessedImageCache()
    barrier = threading.Barrier(8)

    def job(order: int) -> list[Rendered]:
        barrier.wait()
        ordered = turns[order % 3 :] + turns[: order % 3]
        got = [_render(tokenizer, prompter, t, cache) for t in ordered]
        return got[-(order % 3) :] + got[: -(order % 3)] if order % 3 else got

    run: Callable[[int], list[Rendered]] = job
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    for got in results:
        for one, expected in zip(got, want, strict=True):
            _assert_bit_equal(one, expected)
    stats = cache.stats()
    assert stats.entries == 3 and stats.hits + stats.misses == 8 * (1 + 2 + 3)
    assert counter.images == stats.misses  # each miss processed once, each hit not at all


def test_a_cache_salt_is_part_of_the_key() -> None:
    png = _png(0)
    shared = image_key(png, MAX_PIXELS)
    assert image_key(png, MAX_PIXELS, None) == shared
    assert image_key(png, MAX_PIXELS, "a") not in (shared, image_key(png, MAX_PIXELS, "b"))
    assert image_key(png, MAX_PIXELS, "a") == image_key(bytes(png), MAX_PIXELS, "a")
