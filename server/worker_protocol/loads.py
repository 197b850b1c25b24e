"""``GetLoads``: each rank's load from the engine's published stats snapshot (the gauges'
source): running and waiting requests and KV-cache usage, as vLLM's servicer reports them.

With ``--data-parallel-size N`` one ``SchedulerLoad`` per engine core (``dp_rank`` 0..N-1,
``dp_rank_count`` N), from each core's own snapshot; with one core, one entry for rank 0."""

from __future__ import annotations

from datetime import UTC, datetime

from smg_grpc_proto.generated import vllm_engine_pb2

from tokenwire.runtime.engine.protocol import EngineClient, EngineStatsSnapshot

VERSION = "tokenwire"


def scheduler_load(
    snapshot: EngineStatsSnapshot, block_size: int, max_num_seqs: int, dp_rank: int = 0
) -> vllm_engine_pb2.SchedulerLoad:
    used_blocks = max(0, snapshot.kv_blocks_total - snapshot.kv_blocks_free)
    queries = snapshot.prefix_cache_queries
    return vllm_engine_pb2.SchedulerLoad(
        dp_rank=dp_rank,
        num_running_reqs=snapshot.num_running,
        num_waiting_reqs=snapshot.num_waiting,
        num_total_reqs=snapshot.num_running + snapshot.num_waiting,
        num_used_tokens=used_blocks * block_size,
        max_total_num_tokens=snapshot.kv_blocks_total * block_size,
        token_usage=max(0.0, snapshot.kv_cache_usage),
        cache_hit_rate=snapshot.prefix_cache_hits / queries if queries else 0.0,
        max_running_requests=max_num_seqs,
    )


def loads(engine: EngineClient, dp_rank: int | None) -> vllm_engine_pb2.GetLoadsResponse:
    """Every rank's load, or only ``dp_rank``'s (a rank the server lacks: no entries)."""
    info, snapshot = engine.info, engine.stats_snapshot()
    ranks = snapshot.ranks or (snapshot,)
    entries = [
        scheduler_load(s, info.block_size, info.max_num_seqs, rank)
        for rank, s in enumerate(ranks)
        if dp_rank is None or dp_rank == rank
    ]
    return vllm_engine_pb2.GetLoadsResponse(
        timestamp=datetime.now(UTC).isoformat(),
        version=VERSION,
        dp_rank_count=len(ranks),
        loads=entries,
    )
