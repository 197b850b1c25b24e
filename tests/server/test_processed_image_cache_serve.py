"""A session's later turns re-use its transcript's processed images
(``--mm-processor-cache-bytes``): on a real server with a tiny random Qwen2.5-VL (M-RoPE:
each turn's positions depend on its images), the second turn of a session whose first turn
carried an image runs the image processor on nothing, and both turns' greedy tokens and
prompt sizes equal those of a server with the cache off (0), which processes the image on
every turn. The processor counted is the model's own (transformers'), its calls tallied."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerHarness
from tiny_llava import synthetic_image
from tiny_qwen_vl import save_tiny_qwen_vl

from tokenwire.clients import results as r
from tokenwire.clients.client import Client
from tokenwire.clients.content import ImagePart
from tokenwire.runtime.front.images import ImagePrompter
from tokenwire.server.cli import build_parser
from tokenwire.server.grpc.convert import Limits
from tokenwire.server.grpc.images import ImageLimits
from tokenwire.server.serve_args import grpc_settings

IMAGE, START, END, VIDEO = 4, 5, 6, 7  # SmolLM2 special tokens no template produces
OPTIONS: dict[str, Any] = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


class CountingProcessor:
    """The model's real image processor, the images it was given counted."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.images = 0
        self._lock = threading.Lock()

    def __call__(self, *, images: list[Any], **kwargs: Any) -> Any:
        with self._lock:
            self.images += len(images)
        return self.processor(images=images, **kwargs)


def _png(seed: int) -> ImagePart:
    out = io.BytesIO()
    synthetic_image(seed, (40, 48)).save(out, format="PNG")
    return ImagePart.from_bytes(out.getvalue())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Path:
    path = tmp_path_factory.mktemp("qwen2_5_vl-processed-images")
    save_tiny_qwen_vl(path, vocab_size=len(smollm_tokenizer), tokens=(IMAGE, START, END, VIDEO))
    smollm_tokenizer.save_pretrained(path)
    return path


def _served(model_dir: Path, cache_bytes: int) -> tuple[ServerHarness, CountingProcessor]:
    images = ImageLimits(max_images=4, max_bytes=64 << 10, max_pixels=100_000,
                         processor_cache_bytes=cache_bytes)  # fmt: skip
    harness = ServerHarness(
        model_dir, limits=Limits(images=images), max_model_len=512,
        max_num_batched_tokens=512, in_process=True,
    ).start()  # fmt: skip
    frontend = harness.engine.frontend
    assert frontend.images is not None
    counter = CountingProcessor(frontend.images.processor)
    frontend.images = ImagePrompter(frontend.images.spec, counter)
    return harness, counter


@pytest.fixture(scope="module")
def cached(model_dir: Path) -> Iterator[tuple[ServerHarness, CountingProcessor]]:
    harness, counter = _served(model_dir, ImageLimits.processor_cache_bytes)
    yield harness, counter
    harness.stop()


@pytest.fixture(scope="module")
def uncached(model_dir: Path) -> Iterator[tuple[ServerHarness, CountingProcessor]]:
    harness, counter = _served(model_dir, 0)
    yield harness, counter
    harness.stop()


def _turn(events: list[r.SessionEvent]) -> tuple[int, list[int]]:
    start = next(e for e in events if isinstance(e, r.TurnStart))
    assert any(isinstance(e, r.TurnEnd) for e in events)
    return start.prompt_tokens, [
        t for e in events if isinstance(e, r.TextDelta) for t in e.token_ids
    ]


def _session(
    harness: ServerHarness, counter: CountingProcessor
) -> list[tuple[int, int, list[int]]]:
    """Three turns (an image, text, another image): each turn's images processed, prompt
    size and tokens."""
    turns: list[list[str | ImagePart] | str] = [
        ["Look at this: ", _png(1), " What is it?"],
        "And what colour is it?",
        ["Compare it with ", _png(2)],
    ]
    out = []
    with Client(harness.target, timeout=120) as client, client.session() as session:
        for turn in turns:
            before = counter.images
            prompt, tokens = _turn(list(session.send(turn, **OPTIONS)))
            out.append((counter.images - before, prompt, tokens))
    harness.assert_idle()
    return out


def test_later_turns_reuse_the_transcripts_processed_images(
    cached: tuple[ServerHarness, CountingProcessor],
    uncached: tuple[ServerHarness, CountingProcessor],
) -> None:
    on = _session(*cached)
    off = _session(*uncached)
    assert [processed for processed, _, _ in off] == [1, 1, 2]  # every image, every turn
    assert [processed for processed, _, _ in on] == [1, 0, 1]  # only each turn's new one
    assert [(prompt, tokens) for _, prompt, tokens in on] == [
        (prompt, tokens) for _, prompt, tokens in off
    ]
    stats = cached[0].server.tokenizers.processed_images.stats()
    assert (stats.hits, stats.misses, stats.entries) == (2, 2, 2)
    assert uncached[0].server.tokenizers.processed_images.stats().entries == 0
    exported = {
        sample.name: sample.value
        for family in text_string_to_metric_families(
            cached[0].server.telemetry.exposition().decode()
        )
        for sample in family.samples
    }
    assert exported["tokenwire:mm_processor_cache_hits_total"] == 2
    assert exported["tokenwire:mm_processor_cache_misses_total"] == 2
    off_text = uncached[0].server.telemetry.exposition().decode()
    assert "mm_processor_cache" not in off_text  # the cache off: no such series


def test_the_flag_reaches_the_pools_settings() -> None:
    parse = build_parser().parse_args
    default = grpc_settings(parse(["serve"])).limits.images
    assert default.processor_cache_bytes == 256 << 20
    off = grpc_settings(parse(["serve", "--mm-processor-cache-bytes", "0"])).limits.images
    assert off.processor_cache_bytes == 0
    with pytest.raises(ValueError, match="--mm-processor-cache-bytes"):
        ImageLimits(processor_cache_bytes=-1)


def _prefix_hits(harness: ServerHarness) -> float:
    exposition = harness.server.telemetry.exposition().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == "vllm:prefix_cache_hits_total"
    )


def test_a_cache_salt_gets_its_own_processed_images(
    cached: tuple[ServerHarness, CountingProcessor],
) -> None:
    """The same chat under salts a, b, a: b neither hits nor warms a's processed image (nor
    its prefix blocks), so its time to first token reveals nothing of a's images; a's second
    request hits both; all three answer alike (a salt changes what is shared, never what is
    computed). The encoder-output cache's salting: tests/runtime/test_encoder_cache.py."""
    harness, counter = cached
    messages = [{"role": "user", "content": ["Look: ", _png(7), " What is it?"]}]
    seen, answers = [], []
    with Client(harness.target, timeout=120) as client:
        for salt in ["a", "b", "a"]:
            before = (counter.images, _prefix_hits(harness))
            done = client.generate(messages=messages, cache_salt=salt, **OPTIONS)
            seen.append((counter.images - before[0], _prefix_hits(harness) > before[1]))
            answers.append(done.choices[0].token_ids)
    harness.assert_idle()
    assert seen == [(1, False), (1, False), (0, True)]
    assert answers[0] == answers[1] == answers[2]
