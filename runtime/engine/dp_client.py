"""``DPCoreClient``: ``--data-parallel-size N`` engine cores behind one front, with the shape of
one ``CoreClient`` (the front cannot tell; vLLM's DP coordinator, in the front process).

- Requests go where ``DPBalancer`` says (Session holder, then prefix affinity, then load);
  aborts and holder releases go to the core that has them.
- Questions every core must answer (``CheckIdle``, ``ResetPrefixCache``, LoRA changes) go to
  all of them; the front sees one answer, merged once every core has replied.
- Each core's ``StepResult`` reaches the front as it comes, with the snapshot replaced by the
  sum over the cores' latest snapshots, each core's own in its ``ranks`` (the per-core gauges
  and ``GetLoads`` entries read those); its finished requests leave the balancer.
- An ``AddRequest`` that names its ``data_parallel_rank`` goes to that core.
- One core dying ends the server, as with one core: the front sees ``CoreFailed`` and drains.
  (Failing only that core's requests would leave Sessions and stored chains pinned to a dead
  core, and an operator's restart policy already handles a dead server.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.engine.core_client import CoreClient
from tokenwire.runtime.engine.dp_balance import DPBalancer
from tokenwire.runtime.engine.dp_merge import merge_idle, merge_lora, merge_snapshots
from tokenwire.runtime.engine.messages import (
    AbortRequests,
    AddLoRA,
    AddRequest,
    CheckIdle,
    CoreFailed,
    CoreInput,
    CoreOutput,
    IdleReply,
    LoRAReply,
    ReleaseHolder,
    RemoveLoRA,
    ResetPrefixCache,
    ResetReply,
    StepResult,
)
from tokenwire.runtime.engine.protocol import EngineInfo, EngineStatsSnapshot
from tokenwire.runtime.kv_events_config import check_rank_endpoints
from tokenwire.runtime.stats import EngineObserver


def rank_configs(config: EngineConfig) -> list[EngineConfig]:
    """One config per core: the same model and flags, its own ``data_parallel_rank``."""
    size = config.parallel.data_parallel_size
    return [
        dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, data_parallel_rank=rank)
        )
        for rank in range(size)
    ]


class DPCoreClient:
    def __init__(self, config: EngineConfig, cores: list[CoreClient]) -> None:
        self.config = config
        self.cores = cores
        self.balancer = DPBalancer(len(cores), config.cache.block_size)
        self._snapshots = [EngineStatsSnapshot() for _ in cores]
        self._outputs: asyncio.Queue[CoreOutput] = asyncio.Queue()
        self._pumps: list[asyncio.Task[None]] = []
        self._replies: dict[int, list[CoreOutput]] = {}  # call id -> the answers so far
        self._failed = False

    @property
    def pid(self) -> int:
        return self.cores[0].pid

    @property
    def pids(self) -> list[int]:
        return [core.pid for core in self.cores]

    async def start(self) -> EngineInfo:
        started = await asyncio.gather(*(c.start() for c in self.cores), return_exceptions=True)
        failure = next((s for s in started if isinstance(s, BaseException)), None)
        if failure is not None:
            await asyncio.gather(*(c.shutdown() for c in self.cores), return_exceptions=True)
            raise failure
        infos = [s for s in started if isinstance(s, EngineInfo)]
        blocks = infos[0].num_kv_blocks
        self._snapshots = [
            EngineStatsSnapshot(kv_blocks_free=i.num_kv_blocks, kv_blocks_total=i.num_kv_blocks)
            for i in infos
        ]
        for rank, core in enumerate(self.cores):
            self._pumps.append(asyncio.create_task(self._pump(rank, core)))
        # One core's capacity bounds what one request may use; the gauges sum the cores.
        rank_blocks = tuple(i.num_kv_blocks for i in infos)
        return dataclasses.replace(infos[0], num_kv_blocks=blocks, rank_kv_blocks=rank_blocks)

    # ------------------------------------------------------------------ front -> cores
    def send(self, message: CoreInput) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequests):
            self._abort(message.request_ids)
        elif isinstance(message, ReleaseHolder):
            rank = self.balancer.release_holder(message.holder_id)
            for r in range(len(self.cores)) if rank is None else (rank,):
                self.cores[r].send(message)
        elif isinstance(message, CheckIdle | ResetPrefixCache | AddLoRA | RemoveLoRA):
            self._replies[message.call_id] = []
            self._broadcast(message)
        else:  # Shutdown
            self._broadcast(message)

    def _add(self, message: AddRequest) -> None:
        holder = next((c.hold_as for c in message.children if c.hold_as is not None), None)
        lora = message.lora_request.lora_name if message.lora_request is not None else None
        key = {"cache_salt": message.cache_salt, "lora_name": lora, "holder": holder}
        rank = message.data_parallel_rank  # named by the caller (checked by the front)
        if rank is None:
            rank = self.balancer.choose(message.prompt_token_ids, **key)
        ids = [child.request_id for child in message.children]
        self.balancer.assign(rank, message.request_id, ids, message.prompt_token_ids, **key)
        self.cores[rank].send(message)

    def _abort(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self.balancer.rank_of(request_id)
            if rank is not None:
                by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            self.cores[rank].send(AbortRequests(ids))

    def _broadcast(self, message: CoreInput) -> None:
        for core in self.cores:
            core.send(message)

    # ------------------------------------------------------------------ cores -> front
    async def get_output(self) -> CoreOutput:
        return await self._outputs.get()

    async def _pump(self, rank: int, core: CoreClient) -> None:
        while True:
            message = await core.get_output()
            if isinstance(message, CoreFailed):
                if not self._failed:
                    self._failed = True
                    self._outputs.put_nowait(
                        dataclasses.replace(message, message=f"rank {rank}: {message.message}")
                    )
                return
            merged = self._on_output(rank, message)
            if merged is not None:
                self._outputs.put_nowait(merged)

    def _on_output(self, rank: int, message: CoreOutput) -> CoreOutput | None:
        if isinstance(message, StepResult):
            return self._on_step(rank, message)
        if isinstance(message, IdleReply | ResetReply | LoRAReply):
            answers = self._replies.get(message.call_id)
            if answers is None:
                return message
            answers.append(message)
            if len(answers) < len(self.cores):
                return None
            del self._replies[message.call_id]
            return _merge_replies(answers)
        return message

    def _on_step(self, rank: int, result: StepResult) -> StepResult:
        for output in result.outputs:
            if output.finished:
                self.balancer.finished(output.request_id)
        for fault in result.faults:  # an AddRequest that failed: its choices never ran
            self.balancer.failed(fault.request_id)
        for holder in result.evicted_holders:
            self.balancer.release_holder(holder)
        if result.snapshot is None:
            return result
        self._snapshots[rank] = result.snapshot
        self.balancer.observe_waiting(rank, result.snapshot.num_waiting)
        return dataclasses.replace(result, snapshot=merge_snapshots(self._snapshots))

    async def shutdown(self) -> None:
        for pump in self._pumps:
            pump.cancel()
        for pump in self._pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        await asyncio.gather(*(c.shutdown() for c in self.cores), return_exceptions=True)


def _merge_replies(answers: list[CoreOutput]) -> CoreOutput:
    first = answers[0]
    if isinstance(first, IdleReply):
        reports = [a.report for a in answers if isinstance(a, IdleReply)]
        return IdleReply(first.call_id, merge_idle(reports))
    if isinstance(first, ResetReply):
        return ResetReply(first.call_id, all(isinstance(a, ResetReply) and a.ok for a in answers))
    return merge_lora([a for a in answers if isinstance(a, LoRAReply)])


def check_data_parallel(config: EngineConfig) -> None:
    """What ``--data-parallel-size > 1`` cannot be combined with yet (startup errors)."""
    parallel, events = config.parallel, config.kv_events_config
    if parallel.tensor_parallel_size > 1 or parallel.nnodes > 1:
        raise ValueError(
            "--data-parallel-size > 1 runs whole-model engine cores on one node: it cannot be "
            "combined with --tensor-parallel-size > 1 or --nnodes > 1 yet"
        )
    if events is not None and events.publishes_zmq:
        try:
            check_rank_endpoints(events, parallel.data_parallel_size)
        except ValueError as exc:
            raise ValueError(f"--kv-events-config: {exc}") from None


def make_dp_client(
    config: EngineConfig, in_process: bool, core_observer: EngineObserver | None
) -> DPCoreClient:
    check_data_parallel(config)
    if in_process:
        from tokenwire.runtime.engine.inproc_client import InprocCoreClient

        return DPCoreClient(
            config, [InprocCoreClient(c, core_observer) for c in rank_configs(config)]
        )
    from tokenwire.runtime.engine.core_process import MPCoreClient

    return DPCoreClient(config, [MPCoreClient(c, core_observer) for c in rank_configs(config)])
