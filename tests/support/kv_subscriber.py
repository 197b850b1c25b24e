"""A vLLM-style KV-event subscriber for tests: a ZMQ SUB socket on a publisher's endpoint plus
a DEALER on its replay endpoint, decoding every batch with vLLM's own Struct definitions
(``vllm_kv_schema``), gaps filled by replay; ``blocks()`` rebuilds the cached block set."""

from __future__ import annotations

from typing import Any

import msgspec
import zmq
from vllm_kv_schema import KVEventBatch

TOPIC = b"kv"


def apply(blocks: set[int], batch: Any, medium: str = "GPU") -> None:
    """Apply ``batch`` to the blocks of one tier (``medium``; None on the wire is the GPU)."""
    for event in batch.events:
        kind = type(event).__name__
        if kind != "AllBlocksCleared" and (event.medium or "GPU") != medium:
            continue
        if kind == "BlockStored":
            blocks.update(event.block_hashes)
        elif type(event).__name__ == "BlockRemoved":
            blocks.difference_update(event.block_hashes)
        else:
            blocks.clear()


class Subscriber:
    """A vLLM-style SUB + replay client: batches by sequence number, gaps filled by replay."""

    def __init__(
        self, ctx: zmq.Context[Any], endpoint: str, replay: str, topic: bytes = TOPIC
    ) -> None:
        self.topic = topic
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)  # one request, many replies (REQ allows one)
        self.replay.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.batches: dict[int, KVEventBatch] = {}

    def drain(self) -> None:
        while self.sub.poll(50):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic
            self.batches[int.from_bytes(seq, "big")] = self.decoder.decode(payload)

    def replay_from(self, start: int) -> list[int]:
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        seqs = []
        while True:
            empty, seq_bytes, payload = self.replay.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                return seqs
            seqs.append(seq)
            self.batches[seq] = self.decoder.decode(payload)

    def blocks(self, medium: str = "GPU") -> set[int]:
        blocks: set[int] = set()
        seqs = sorted(self.batches)
        assert seqs == list(range(1, len(seqs) + 1)), "a gap the replay did not fill"
        for seq in seqs:
            apply(blocks, self.batches[seq], medium)
        return blocks
