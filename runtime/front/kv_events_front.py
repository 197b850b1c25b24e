"""The front's KV-event side: the ``KVEventHub`` and, with ``"publisher": "zmq"``, the ZMQ
publisher it feeds. Built by the ``AsyncEngine`` when ``--kv-events-config`` enables events."""

from __future__ import annotations

import asyncio

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.front.kv_event_hub import KVEventHub
from tokenwire.runtime.front.kv_event_publisher import ZmqKVEventPublisher


class KVEventsFront:
    def __init__(self, config: EngineConfig) -> None:
        events = config.kv_events_config
        assert events is not None and events.enable_kv_cache_events
        self.config = events
        self.hub = KVEventHub(config.cache.block_size, events.buffer_steps)
        self.publisher: ZmqKVEventPublisher | None = None

    @staticmethod
    def make(config: EngineConfig) -> KVEventsFront | None:
        events = config.kv_events_config
        if events is None or not events.enable_kv_cache_events:
            return None
        return KVEventsFront(config)

    def start(self) -> None:
        """Bind / connect the ZMQ sockets (a bad endpoint raises ``ValueError`` naming the
        flag)."""
        if not self.config.publishes_zmq:
            return
        try:
            self.publisher = ZmqKVEventPublisher(self.config)
        except Exception as exc:  # zmq.ZMQError: address in use, bad endpoint
            raise ValueError(
                f"--kv-events-config endpoint {self.config.endpoint!r} / replay_endpoint "
                f"{self.config.replay_endpoint!r}: {exc}"
            ) from None
        self.hub.add_sink(self.publisher.put)

    async def close(self) -> None:
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close)
            self.publisher = None
