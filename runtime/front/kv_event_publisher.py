"""``ZmqKVEventPublisher``: vLLM's ``ZmqEventPublisher`` wire, fed by the ``KVEventHub``.

Multipart ``[topic, seq (8 bytes big-endian), payload]`` on a PUB socket, ``payload`` the
msgspec MessagePack of a vLLM-schema ``KVEventBatch``. With ``replay_endpoint`` a ROUTER
socket serves replays: a client (REQ or DEALER) sends ``seq`` (8 bytes big-endian) and gets
``[seq, payload]`` for every buffered batch from ``seq`` on, then ``[-1 (8 bytes signed),
b""]``. Encoding and sending run on a thread of their own; ``put`` (called on the front's
event loop) only queues and never blocks: a full queue drops the batch (counted in
``dropped``; a subscriber sees the gap in the numbers and replays).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from typing import Any

import msgspec

from tokenwire.runtime.core.kv_events import KVEventBatch
from tokenwire.runtime.kv_events_config import KVEventsConfig

logger = logging.getLogger("tokenwire.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ``::``, ipc or inproc endpoint; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self.config = config
        self.dropped = 0
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(
            config.max_queue_size
        )
        self._ctx = zmq.Context()
        self._pub: Any = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if binds(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        self._replay: Any = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = config.topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._thread = threading.Thread(target=self._run, name="tokenwire-kv-events", daemon=True)
        self._thread.start()

    def put(self, seq: int, batch: KVEventBatch) -> None:
        """Queue one batch for sending (never blocks)."""
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(timeout=5.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # a bad request must not stop publishing
                    logger.exception("KV event replay failed")
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:
                logger.exception("KV event publish failed")
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignored a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
