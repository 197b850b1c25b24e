"""``SubscribeKvEvents`` from the front's ``KVEventStream`` (the one core's ``KVEventHub``, or
with ``--data-parallel-size N`` every core's batches merged, each with its ``dp_rank``): the
snapshot (``start_sequence_number`` 0 or older than the replay window; one chunk per rank) or
the replay from N, then live batches, each as the ``smg.grpc.common.KvEventBatch`` the gateway
reads, with the load record of the batch's rank attached. A subscriber that falls a whole
replay window behind is ended with ABORTED (resubscribe from its last sequence number); a
cancelled call leaves the stream at once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from itertools import count

import grpc
from smg_grpc_proto.generated import common_pb2

from tokenwire.runtime.engine.protocol import EngineClient
from tokenwire.runtime.front.kv_event_hub import KVEventStream, SubscriberLagged
from tokenwire.server.grpc.errors import ServiceError, abort
from tokenwire.server.worker_protocol.kv_events import batch_to_proto, engine_load
from tokenwire.v1 import errors_pb2


class HubKvEvents:
    """The servicer's ``KvEventSource`` over one engine's event stream."""

    def __init__(self, engine: EngineClient, hub: KVEventStream) -> None:
        self.engine = engine
        self.hub = hub
        self._samples = count(1)

    async def subscribe(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        max_running = self.engine.info.max_num_seqs
        try:
            async for item in self.hub.subscribe(request.start_sequence_number):
                snapshot = self.engine.stats_snapshot()
                rank = item.batch.data_parallel_rank or 0
                if len(snapshot.ranks) > rank:  # several cores: the batch's own core
                    snapshot = snapshot.ranks[rank]
                load = engine_load(snapshot, max_running, next(self._samples))
                yield batch_to_proto(item, load)
        except SubscriberLagged as lagged:
            await abort(
                context,
                ServiceError(
                    grpc.StatusCode.ABORTED, errors_pb2.ERROR_REASON_UNSPECIFIED, str(lagged)
                ),
            )
