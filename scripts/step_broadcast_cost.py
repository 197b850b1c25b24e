#!/usr/bin/env python3
"""How a step's ``SchedulerOutput`` should reach the other ranks: measured, not assumed.

Two processes (rank 0 and rank 1) ping-pong an encoded decode-step ``SchedulerOutput`` (64
running requests, as msgspec bytes) N times over each candidate channel and report half the
median round trip: (a) ``TPGroup.broadcast_bytes`` over the group's gloo channel (what the
executor uses: it also reaches ranks on other nodes), (b) a ZMQ PUSH/PULL pair over ``ipc://``
(one socket per rank; same-node only without more sockets).

    .venv/bin/python scripts/step_broadcast_cost.py --iterations 2000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch

from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.distributed.init import free_loopback_port
from tokenwire.runtime.ipc.worker_messages import ExecutorCodec, Step
from tokenwire.runtime.scheduler_output import CachedRequestData, SchedulerOutput


def decode_step(num_requests: int) -> bytes:
    so = SchedulerOutput(
        step_id=1234,
        new_reqs=[],
        cached_reqs=CachedRequestData(
            request_ids=[f"anon/req-{i}" for i in range(0, num_requests, 16)],
            resumed_from_preemption=[False] * ((num_requests + 15) // 16),
            new_block_ids=[[1000 + i] for i in range(0, num_requests, 16)],
            num_computed_tokens=[300] * ((num_requests + 15) // 16),
        ),
        num_scheduled_tokens={f"anon/req-{i}": 1 for i in range(num_requests)},
        total_num_scheduled_tokens=num_requests,
        num_prefill_tokens=0,
        num_decode_tokens=num_requests,
        finished_req_ids=frozenset(),
        preempted_req_ids=frozenset(),
    )
    return ExecutorCodec().encode(Step(so))


def gloo_round_trips(group: TPGroup, payload: bytes, n: int) -> list[float]:
    times = []
    dist = torch.distributed
    for _ in range(n):
        t0 = time.perf_counter()
        data = group.broadcast_bytes(payload if group.rank == 0 else None)
        ack = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(ack, src=1, group=group.cpu_group)  # the answer back
        times.append(time.perf_counter() - t0)
    return times


def zmq_round_trips(rank: int, folder: str, payload: bytes, n: int) -> list[float]:
    import zmq

    context = zmq.Context()
    out, inp = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    if rank == 0:
        out.bind(f"ipc://{folder}/a")
        inp.bind(f"ipc://{folder}/b")
    else:
        inp.connect(f"ipc://{folder}/a")
        out.connect(f"ipc://{folder}/b")
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        if rank == 0:
            out.send(payload)
            inp.recv()
        else:
            out.send(inp.recv()[:8])
        times.append(time.perf_counter() - t0)
    out.close(linger=0)
    inp.close(linger=0)
    context.term()
    return times


def rank_main(rank: int, port: int, folder: str, n: int, out: Any) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    group = TPGroup(rank, 2, torch.distributed.group.WORLD, torch.distributed.group.WORLD)
    payload = decode_step(64)
    gloo_round_trips(group, payload, 100)  # warm-up
    gloo = gloo_round_trips(group, payload, n)
    group.barrier()
    zmq_times = zmq_round_trips(rank, folder, payload, n)
    if rank == 0:
        out.put({"payload_bytes": len(payload), "gloo": gloo, "zmq": zmq_times})
    torch.distributed.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iterations", type=int, default=2000)
    args = p.parse_args()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port, folder = free_loopback_port(), tempfile.mkdtemp(prefix="tokenwire-bcast-")
    procs = [
        ctx.Process(target=rank_main, args=(r, port, folder, args.iterations, out)) for r in (0, 1)
    ]
    for proc in procs:
        proc.start()
    result = out.get(timeout=600)
    for proc in procs:
        proc.join()
    summary = {"bench": "step_broadcast_cost", "payload_bytes": result["payload_bytes"]}
    print(f"decode step of 64 requests: {result['payload_bytes']} bytes, "
          f"{args.iterations} round trips each (one-way = half the round trip):")  # fmt: skip
    for name in ("gloo", "zmq"):
        times = sorted(result[name])
        half_median = 1e6 * statistics.median(times) / 2
        half_p99 = 1e6 * times[int(0.99 * len(times))] / 2
        summary[f"{name}_one_way_median_us"] = round(half_median, 1)
        summary[f"{name}_one_way_p99_us"] = round(half_p99, 1)
        label = "gloo broadcast (size + bytes)" if name == "gloo" else "ZMQ PUSH/PULL ipc"
        print(f"  {label:32s} median {half_median:8.1f} us   p99 {half_p99:8.1f} us")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
