"""The front's KV-event side: one ``KVEventHub`` per engine core (data-parallel rank) and, with
``"publisher": "zmq"``, one ZMQ publisher per hub. Built by the ``AsyncEngine`` when
``--kv-events-config`` enables events.

With ``--data-parallel-size N`` the ranks are kept apart the way vLLM keeps them: rank ``r``'s
batches get its own sequence numbers (1, 2, ...), its own block set and replay buffer, and go
out on its own endpoints (``KVEventsConfig.for_rank``: the port plus ``r``), each batch stamped
with ``data_parallel_rank``. A replay request for N on rank ``r``'s replay endpoint therefore
names exactly one batch. The in-process ``stream`` (the gRPC ``SubscribeKvEvents`` stream) is
the one core's hub, or with several cores their ``MergedKVEvents``: every rank's batches, in
the order they arrived, numbered 1, 2, ... of its own, each stamped with its rank."""

from __future__ import annotations

import asyncio

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.core.kv_events import KVEventBatch
from tokenwire.runtime.front.kv_event_hub import KVEventHub, KVEventStream
from tokenwire.runtime.front.kv_event_merge import MergedKVEvents
from tokenwire.runtime.front.kv_event_publisher import ZmqKVEventPublisher


class KVEventsFront:
    def __init__(self, config: EngineConfig) -> None:
        events = config.kv_events_config
        assert events is not None and events.enable_kv_cache_events
        self.config = events
        ranks = range(config.parallel.data_parallel_size)
        self.hubs = [KVEventHub(config.cache.block_size, events.buffer_steps, r) for r in ranks]
        self.publishers: list[ZmqKVEventPublisher] = []
        # Several cores: one merged stream for gRPC (added before the publishers' sinks).
        self.merged = MergedKVEvents(self.hubs, events.buffer_steps) if len(ranks) > 1 else None

    @staticmethod
    def make(config: EngineConfig) -> KVEventsFront | None:
        events = config.kv_events_config
        if events is None or not events.enable_kv_cache_events:
            return None
        return KVEventsFront(config)

    @property
    def stream(self) -> KVEventStream:
        """What the gRPC stream subscribes to: the one core's hub, or every core's merged."""
        return self.hubs[0] if self.merged is None else self.merged

    @property
    def publisher(self) -> ZmqKVEventPublisher | None:
        """Rank 0's publisher (the only one with one core); None before ``start``."""
        return self.publishers[0] if self.publishers else None

    def publish(self, batch: KVEventBatch) -> None:
        """Hand one core batch to its rank's hub (a batch without a rank is rank 0's)."""
        rank = batch.data_parallel_rank
        self.hubs[0 if rank is None else rank].publish(batch)

    def start(self) -> None:
        """Bind / connect each rank's ZMQ sockets (a bad endpoint raises ``ValueError`` naming
        the flag, after closing the ranks already started)."""
        if not self.config.publishes_zmq:
            return
        for hub in self.hubs:
            rank = hub.data_parallel_rank
            ranked = self.config.for_rank(rank)
            try:
                self.publishers.append(ZmqKVEventPublisher(ranked))
            except Exception as exc:  # zmq.ZMQError: address in use, bad endpoint
                self._close_publishers()
                where = f" (data-parallel rank {rank})" if len(self.hubs) > 1 else ""
                raise ValueError(
                    f"--kv-events-config endpoint {ranked.endpoint!r} / replay_endpoint "
                    f"{ranked.replay_endpoint!r}{where}: {exc}"
                ) from None
        for hub, publisher in zip(self.hubs, self.publishers, strict=True):
            hub.add_sink(publisher.put)

    async def close(self) -> None:
        await asyncio.to_thread(self._close_publishers)

    def _close_publishers(self) -> None:
        for publisher in self.publishers:
            publisher.close()
        self.publishers = []
