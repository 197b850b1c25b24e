"""KV events of image blocks (#33): a tiny random LLaVA served with KV events on (ZMQ and the
vLLM worker protocol's ``SubscribeKvEvents``), a chat with an image part sent as a gRPC
``ImagePart``. Every block whose hash took the image's key publishes it: on ZMQ (decoded with
vLLM's Struct definitions) its ``extra_keys`` entry lists ``(identifier, offset)`` (the image's
content hash and its first placeholder's position relative to the block's first token, as
vLLM's), blocks before and after the image none; the hashes recompute from the token ids and
those keys with docs/fleet.md's recipe; on gRPC the same blocks carry
``KvBlockExtraKey.multimodal``. Two images give different identifiers."""

from __future__ import annotations

import hashlib
import io
import struct
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
import zmq
from kv_subscriber import Subscriber as ZmqSubscriber
from server_harness import ServerHarness
from smg_grpc_proto.generated import common_pb2 as smg
from smg_grpc_proto.generated import vllm_engine_pb2_grpc
from tiny_llava import save_tiny_llava, synthetic_image
from vllm_kv_schema import BlockStored

from tokenwire.runtime.kv_events_config import KVEventsConfig
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

IMAGE_TOKEN = 4
PATCHES = 16
BLOCK = 16  # the default: the image's 16-token run spans two blocks, text blocks around it


def _png(seed: int) -> bytes:
    out = io.BytesIO()
    synthetic_image(seed).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def harness_model(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Path:
    path = tmp_path_factory.mktemp("llava-kv-events")
    save_tiny_llava(path, len(smollm_tokenizer), IMAGE_TOKEN, max_position=512)
    smollm_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv",
    )
    return dict(
        worker_protocol="vllm",
        kv_events=events,
        max_model_len=512,
        max_num_batched_tokens=512,
        in_process=True,
    )


class _GrpcEvents:
    """One SubscribeKvEvents stream read on a thread."""

    def __init__(self, channel: grpc.Channel) -> None:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        self.call = stub.SubscribeKvEvents(smg.SubscribeKvEventsRequest(start_sequence_number=0))
        self.blocks: list[smg.KvBlock] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                with self.changed:
                    for event in batch.events:
                        if event.WhichOneof("data") == "stored":
                            self.blocks.extend(event.stored.blocks)
                    self.changed.notify_all()
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.CANCELLED, err

    def wait_for(self, count: int) -> list[smg.KvBlock]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.blocks) >= count, 30), self.blocks
            return list(self.blocks)

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(10)


def _generate(gen: generation_pb2_grpc.GenerationServiceStub, png: bytes) -> Any:
    image = common_pb2.ImagePart(data=png, mime_type="image/png")
    parts = [
        common_pb2.ContentPart(text="Look at this: "),
        common_pb2.ContentPart(image=image),
        common_pb2.ContentPart(text=" What is it?"),
    ]
    request = generation_pb2.GenerateRequest(
        chat=common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", parts=parts)]),
        sampling=common_pb2.SamplingOptions(temperature=0.0),
        stopping=common_pb2.StoppingOptions(max_tokens=1),
    )
    return gen.Generate(request, timeout=120)


def _chain_hash(parent: bytes, tokens: list[int], extra: Any) -> bytes:
    """One step of docs/fleet.md's recipe, image keys included."""
    key = b"".join(
        b"image:" + str(p[0]).encode() if isinstance(p, list | tuple) else str(p).encode()
        for p in extra or ()
    )
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}I", *tokens) + key).digest()


def _blocks(stored: list[BlockStored]) -> dict[int, tuple[int | None, list[int], Any]]:
    """Every published block: hash -> (parent hash, token ids, extra keys)."""
    out: dict[int, tuple[int | None, list[int], Any]] = {}
    for event in stored:
        parent = event.parent_block_hash
        for i, h in enumerate(event.block_hashes):
            extra = None if event.extra_keys is None else event.extra_keys[i]
            out[h] = (parent, event.token_ids[i * BLOCK : (i + 1) * BLOCK], extra)
            parent = h
    return out


def _zmq_stored(harness: ServerHarness, ctx: zmq.Context[Any]) -> list[BlockStored]:
    publisher = harness.engine._kv_events.publisher if harness.engine._kv_events else None
    assert publisher is not None and publisher.replay_endpoint is not None
    sub = ZmqSubscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
    sub.replay_from(1)
    return [e for b in sub.batches.values() for e in b.events if isinstance(e, BlockStored)]


def test_image_blocks_publish_their_image_keys(
    channel: grpc.Channel, gen: generation_pb2_grpc.GenerationServiceStub, harness: ServerHarness
) -> None:
    grpc_events = _GrpcEvents(channel)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        for seed in (1, 2):
            _generate(gen, _png(seed))
        blocks = _blocks(_zmq_stored(harness, ctx))
        image_blocks = [h for h, (_, tokens, _) in blocks.items() if IMAGE_TOKEN in tokens]
        grpc_blocks = grpc_events.wait_for(len(blocks))
    finally:
        ctx.destroy(linger=0)
        grpc_events.close()
    assert len(image_blocks) >= 4  # two images, each run over two blocks
    identifiers = set()
    for h, (_, tokens, extra) in blocks.items():
        images = [p for p in extra or () if isinstance(p, list)]
        # a block carries an image key exactly when it holds the image's placeholders
        assert bool(images) == (IMAGE_TOKEN in tokens), (tokens, extra)
        chain = [h]  # walk to the root, then recompute the whole chain from its tokens
        while blocks[chain[-1]][0] is not None:
            chain.append(blocks[chain[-1]][0])  # type: ignore[arg-type]
        parent, flat = b"", []
        for link in reversed(chain):
            _, link_tokens, link_extra = blocks[link]
            parent = _chain_hash(parent, link_tokens, link_extra)
            flat += link_tokens
        assert int.from_bytes(parent, "big") & (2**64 - 1) == h
        for identifier, offset in images:
            identifiers.add(identifier)
            at = len(flat) - BLOCK + offset  # relative to the block's first token (vLLM's)
            assert flat[at] == IMAGE_TOKEN and flat[at - 1] != IMAGE_TOKEN
            run = flat[at : at + PATCHES]  # as far as this block reaches
            assert run == [IMAGE_TOKEN] * len(run) and -PATCHES < offset < BLOCK
    assert len(identifiers) == 2  # one per image
    multimodal = {
        (k.multimodal.identifier, k.multimodal.offset)
        for b in grpc_blocks
        for k in b.extra_keys
        if k.WhichOneof("key") == "multimodal"
    }
    assert {m[0] for m in multimodal} == identifiers
    for block in grpc_blocks:  # the same blocks carry them on gRPC
        has_key = any(k.HasField("multimodal") for k in block.extra_keys)
        assert has_key == (IMAGE_TOKEN in block.token_ids)
    harness.assert_idle()
