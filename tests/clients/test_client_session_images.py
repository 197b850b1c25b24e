"""Images in Sessions (#33): a turn's ``user_message`` as parts, strings and ``ImagePart``s,
through the typed clients against a real server on a tiny random Qwen2.5-VL (M-RoPE: each
turn's prompt positions depend on the images before them).

The session keeps the image: the next text turn's greedy tokens equal a one-shot
``generate()`` of the whole conversation (the image's user message, the reply, the new
message), and its prompt reuses the KV of everything up to and past the image. A session
reopened with that history (what the async client's reconnect sends) answers the same. The
server's image limit counts the whole transcript: a second image is refused naming the new
turn's part, and the session goes on. Nothing is left in the engine afterwards."""

from __future__ import annotations

import asyncio
import io
import queue
from pathlib import Path
from typing import Any

import pytest
from server_harness import ServerHarness
from tiny_llava import synthetic_image
from tiny_qwen_vl import save_tiny_qwen_vl

from tokenwire.clients import results as r
from tokenwire.clients.async_client import AsyncClient
from tokenwire.clients.client import Client
from tokenwire.clients.content import ImagePart
from tokenwire.clients.convert import session_turn
from tokenwire.clients.errors import InvalidArgumentError
from tokenwire.clients.session_transcript import Transcript
from tokenwire.server.grpc.convert import Limits
from tokenwire.server.grpc.images import ImageLimits
from tokenwire.v1 import generation_pb2 as gen
from tokenwire.v1.generation_pb2_grpc import GenerationServiceStub

# SmolLM2 special tokens no template or user text produces: image pad, vision start and
# end, video pad.
IMAGE, START, END, VIDEO = 4, 5, 6, 7
NEW_TOKENS = 6
PLACEHOLDERS = 30  # a 40 x 48 image: 8 x 8 pixels per placeholder
OPTIONS: dict[str, Any] = dict(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _png(seed: int) -> ImagePart:
    out = io.BytesIO()
    synthetic_image(seed, (40, 48)).save(out, format="PNG")
    return ImagePart.from_bytes(out.getvalue())


FIRST: list[str | ImagePart] = ["Look at this: ", _png(1), " What is it?"]
SECOND = "And what colour is it?"


@pytest.fixture(scope="module")
def harness_model(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Path:
    path = tmp_path_factory.mktemp("qwen2_5_vl-sessions")
    save_tiny_qwen_vl(path, vocab_size=len(smollm_tokenizer), tokens=(IMAGE, START, END, VIDEO))
    smollm_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    limits = Limits(images=ImageLimits(max_images=1, max_bytes=64 << 10, max_pixels=100_000))
    return dict(limits=limits, max_model_len=512, max_num_batched_tokens=512, in_process=True)


def _turn(events: list[r.SessionEvent]) -> tuple[r.TurnStart, str, list[int]]:
    start = next(e for e in events if isinstance(e, r.TurnStart))
    deltas = [e for e in events if isinstance(e, r.TextDelta)]
    assert any(isinstance(e, r.TurnEnd) for e in events)
    return start, "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]


def test_an_image_turn_stays_in_the_session(harness: ServerHarness) -> None:
    with Client(harness.target, timeout=120) as client:
        with client.session() as session:
            start1, reply1, _ = _turn(list(session.send(FIRST, **OPTIONS)))
            start2, _, tokens2 = _turn(list(session.send(SECOND, **OPTIONS)))
        conversation = [
            {"role": "user", "content": FIRST},
            {"role": "assistant", "content": reply1},
            {"role": "user", "content": SECOND},
        ]
        one_shot = client.generate(messages=conversation, **OPTIONS)
        assert one_shot.choices[0].token_ids == tokens2
        assert one_shot.usage.prompt_tokens == start2.prompt_tokens
        # The image's placeholders are in the first prompt, and its KV is reused by the next.
        assert start1.prompt_tokens > PLACEHOLDERS
        assert start2.cached_tokens >= start1.prompt_tokens - 16  # all but a partial block
        with client.session() as other:  # a different image: another answer to SECOND
            _turn(list(other.send(["Look at this: ", _png(9), " What is it?"], **OPTIONS)))
            _, _, other_tokens = _turn(list(other.send(SECOND, **OPTIONS)))
        assert other_tokens != tokens2
    harness.assert_idle()


def test_a_reopened_session_keeps_its_image(harness: ServerHarness) -> None:
    """The async client's transcript holds the image parts; a session opened with that
    history answers the next turn as the original session does."""
    transcript = Transcript()

    async def run() -> tuple[list[int], list[int]]:
        async with (
            AsyncClient(harness.target, timeout=120) as client,
            client.session() as session,
        ):
            first = [e async for e in session.send(FIRST, **OPTIONS)]
            transcript.start(session_turn(FIRST, None, None, OPTIONS).turn)
            for e in first:
                if isinstance(e, r.TextDelta):
                    transcript.reply(e.index, e.text, e.token_ids)
            transcript.commit()
            original = _turn([e async for e in session.send(SECOND, **OPTIONS)])[2]
        opening = transcript.opening(gen.SessionRequest(open=gen.SessionOpen()))
        assert [p.WhichOneof("part") for p in opening.open.history[0].parts] == [
            "text", "image", "text",
        ]  # fmt: skip
        return original, _reopened(harness, opening)

    original, reopened = asyncio.run(run())
    assert reopened == original
    harness.assert_idle()


def _reopened(harness: ServerHarness, opening: gen.SessionRequest) -> list[int]:
    """Open a session with ``opening``'s history, run SECOND, read it to its end, close."""
    outbox: queue.Queue[gen.SessionRequest | None] = queue.Queue()
    outbox.put(opening)
    outbox.put(session_turn(SECOND, None, None, OPTIONS))
    ids: list[int] = []
    with harness.channel() as channel:
        call = GenerationServiceStub(channel).Session(iter(outbox.get, None))
        for message in call:
            kind = message.WhichOneof("message")
            assert kind != "turn_end" or not message.turn_end.HasField("error"), message
            if kind == "delta":
                ids.extend(message.delta.delta.token_ids)
            elif kind == "turn_end":
                outbox.put(None)  # half-close: the session ends
    return ids


def test_the_image_limit_counts_the_transcript(harness: ServerHarness) -> None:
    with Client(harness.target, timeout=120) as client, client.session() as session:
        _turn(list(session.send(FIRST, **OPTIONS)))
        with pytest.raises(InvalidArgumentError) as refused:
            list(session.send(["and this one: ", _png(2)], **OPTIONS))
        assert "user_content.parts[1]" in str(refused.value)
        assert "--max-images-per-request" in str(refused.value)
        _, _, tokens = _turn(list(session.send(SECOND, **OPTIONS)))  # it goes on
        assert len(tokens) == NEW_TOKENS
        with pytest.raises(ValueError, match="no parts"):
            session.send([], **OPTIONS)  # refused before anything is sent
    harness.assert_idle()
