"""``GetLoads``: one rank's load from the engine's published stats snapshot (the gauges'
source): running and waiting requests and KV-cache usage, as vLLM's servicer reports them."""

from __future__ import annotations

from datetime import UTC, datetime

from smg_grpc_proto.generated import vllm_engine_pb2

from tokenwire.runtime.engine.protocol import EngineClient, EngineStatsSnapshot

VERSION = "tokenwire"


def scheduler_load(
    snapshot: EngineStatsSnapshot, block_size: int, max_num_seqs: int
) -> vllm_engine_pb2.SchedulerLoad:
    used_blocks = max(0, snapshot.kv_blocks_total - snapshot.kv_blocks_free)
    queries = snapshot.prefix_cache_queries
    return vllm_engine_pb2.SchedulerLoad(
        dp_rank=0,
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
    """Rank 0's load (``dp_rank`` of another rank: no entries)."""
    info = engine.info
    entries = []
    if dp_rank is None or dp_rank == 0:
        entries.append(scheduler_load(engine.stats_snapshot(), info.block_size, info.max_num_seqs))
    return vllm_engine_pb2.GetLoadsResponse(
        timestamp=datetime.now(UTC).isoformat(),
        version=VERSION,
        dp_rank_count=1,
        loads=entries,
    )
