"""Tensor-parallel ranks in threads or gloo processes, and the checks that every rank computed
the same."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch

from tokenwire.kernels.kv_quant import LayerKVCache
from tokenwire.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.loader.model_loader import load_model
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenwire.runtime.worker.model_runner import ModelRunner
from tokenwire.runtime.worker.runner_settings import RunnerSettings

CPU = torch.device("cpu")


ATOL = 1e-4


# ----------------------------------------------------------------------------- the script
def _prompt(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=gen).tolist()


def _step(
    step_id: int,
    schedule: dict[str, int],
    new: list[NewRequestData] | None = None,
    cached: CachedRequestData | None = None,
    finished: frozenset[str] = frozenset(),
) -> SchedulerOutput:
    decode = sum(1 for n in schedule.values() if n == 1)
    return SchedulerOutput(
        step_id=step_id,
        new_reqs=new or [],
        cached_reqs=cached or CachedRequestData(),
        num_scheduled_tokens=schedule,
        total_num_scheduled_tokens=sum(schedule.values()),
        num_prefill_tokens=sum(schedule.values()) - decode,
        num_decode_tokens=decode,
        finished_req_ids=finished,
        preempted_req_ids=frozenset(),
    )


def script() -> list[SchedulerOutput]:
    """A (greedy, logprobs + prompt logprobs), C (greedy, a 40-token prompt prefilled in two
    chunks) and B (seeded sampling) through prefill, a mixed decode + prefill step, decodes
    (one crossing into a new block) and A finishing."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2)
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, logprobs=2)
    a, c, b = _prompt(0, 20), _prompt(1, 40), _prompt(2, 14)
    return [
        _step(
            0,
            {"A": 20, "C": 24},
            new=[
                NewRequestData("A", a, greedy, [1, 2], 0),
                NewRequestData("C", c, plain, [5, 6, 7], 0),
            ],
        ),
        _step(1, {"A": 1, "C": 16, "B": 14}, new=[NewRequestData("B", b, seeded, [3], 0)]),
        _step(2, {"A": 1, "C": 1, "B": 1}),
        _step(3, {"A": 1, "C": 1, "B": 1}, cached=CachedRequestData(["B"], [False], [[4]], [16])),
        _step(4, {"C": 1, "B": 1}, finished=frozenset({"A"})),
    ]


def _plain(out: ModelOutput) -> dict[str, Any]:
    return {
        "req_ids": list(out.req_ids),
        "tokens": list(out.sampled_token_ids),
        "logprobs": {
            rid: (lp.token_ids, lp.logprobs, lp.rank) for rid, lp in sorted(out.logprobs.items())
        },
        "prompt_logprobs": {
            rid: [None if e is None else (e.token_ids, e.logprobs, e.rank) for e in entries]
            for rid, entries in sorted(out.prompt_logprobs.items())
        },
    }


@torch.inference_mode()
def run_rank(tp: TPGroup, model_dir: str, load_format: str = "auto") -> dict[str, Any]:
    """What one rank sees: the runner's outputs over the script, direct forward logits (a
    prefill then a decode through the paged cache) and the logits of zero rows."""
    from forward_inputs import Chunk, make_meta

    config = ModelConfig(model=model_dir, load_format=load_format, seed=5)
    loaded = load_model(config, CPU, torch.float32, tp=tp)
    model = loaded.model
    cache, scheduler = CacheConfig(num_gpu_blocks_override=24), SchedulerConfig(max_num_seqs=8)
    settings = RunnerSettings.from_config(EngineConfig(cache=cache, scheduler=scheduler))
    runner = ModelRunner(loaded, settings, CPU, tp=tp)
    outputs = [_plain(runner.execute_model(so)) for so in script()]

    shape = (8, 16, model.num_local_kv_heads, loaded.arch.head_dim)
    kv = [
        LayerKVCache(torch.zeros(shape), torch.zeros(shape))
        for _ in range(loaded.arch.num_hidden_layers)
    ]
    tokens = _prompt(9, 21)
    logits = []
    for chunk in (Chunk(tokens[:20], 0, [2, 5]), Chunk(tokens[20:], 20, [2, 5])):
        ids = torch.tensor(chunk.tokens, dtype=torch.int64)
        positions = torch.arange(chunk.start, chunk.start + len(chunk.tokens))
        logits.append(model.compute_logits(model(ids, positions, kv, make_meta([chunk]))))
    empty = model.compute_logits(torch.empty(0, loaded.arch.hidden_size))
    return {
        "outputs": outputs,
        "logits": torch.cat(logits),
        "kv_cache_heads": runner.kv_cache.layers[0][0].shape[2],
        "num_local_kv_heads": model.num_local_kv_heads,
        "empty_logits_shape": tuple(empty.shape),
    }


# ----------------------------------------------------------------------------- gloo ranks
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _rank_main(rank: int, world_size: int, port: int, conn: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    tp = TPGroup(rank, world_size, dist.group.WORLD, dist.new_group(backend="gloo"))
    try:
        while True:
            task = conn.recv()
            if task is None:
                break
            fn, args = task
            try:
                conn.send(("ok", fn(tp, *args)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class GlooRanks:
    """Two spawned processes on one gloo group; ``run(fn, *args)`` calls ``fn(tp, *args)`` on
    every rank and returns the results in rank order."""

    def __init__(self, world_size: int = 2) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.conns = []
        self.procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, world_size, port, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        for conn in self.conns:
            conn.send((fn, args))
        results = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(120):
                raise TimeoutError(f"TP rank {rank} did not answer within 120 s")
            status, value = conn.recv()
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


# ----------------------------------------------------------------------------- comparisons
def assert_same_run(tp: dict[str, Any], ref: dict[str, Any]) -> None:
    """TP outputs equal TP=1: same tokens and logprob token ids, values within ATOL."""
    assert len(tp["outputs"]) == len(ref["outputs"])
    for step, (got, want) in enumerate(zip(tp["outputs"], ref["outputs"], strict=True)):
        assert got["req_ids"] == want["req_ids"], step
        assert got["tokens"] == want["tokens"], step
        assert got["logprobs"].keys() == want["logprobs"].keys(), step
        for rid, (ids, lps, rank) in got["logprobs"].items():
            want_ids, want_lps, want_rank = want["logprobs"][rid]
            assert (ids, rank) == (want_ids, want_rank), (step, rid)
            assert max(abs(x - y) for x, y in zip(lps, want_lps, strict=True)) <= ATOL
        assert got["prompt_logprobs"].keys() == want["prompt_logprobs"].keys(), step
        for rid, entries in got["prompt_logprobs"].items():
            for entry, want_entry in zip(entries, want["prompt_logprobs"][rid], strict=True):
                if entry is None or want_entry is None:
                    assert entry is want_entry is None
                    continue
                assert entry[0] == want_entry[0] and entry[2] == want_entry[2], (step, rid)
                assert max(abs(x - y) for x, y in zip(entry[1], want_entry[1], strict=True)) <= ATOL
    diff = (tp["logits"] - ref["logits"]).abs().max().item()
    assert tp["logits"].shape == ref["logits"].shape
    assert diff <= ATOL, f"max abs logit diff {diff:.3e}"
    assert torch.equal(tp["logits"].argmax(-1), ref["logits"].argmax(-1))


def assert_ranks_identical(results: list[dict[str, Any]]) -> None:
    """Every rank gathered the same logits bitwise, hence sampled and reported the same."""
    first = results[0]
    for other in results[1:]:
        assert other["outputs"] == first["outputs"]
        assert torch.equal(other["logits"], first["logits"])


# ----------------------------------------------------------------------------- thread ranks
class _Exchange:
    """In-memory all-gather among ``n`` threads."""

    def __init__(self, n: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * n
        self.barrier = threading.Barrier(n, timeout=60)

    def gather(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        parts = [t for t in self.slots if t is not None]
        self.barrier.wait()  # everyone has read before the next round overwrites
        return parts


class ThreadTPGroup(TPGroup):
    """A TP group whose ranks are threads of this process (``device_group``: the exchange)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self.device_group.gather(self.rank, tensor)
        total = parts[0].clone()
        for part in parts[1:]:  # the same order on every rank: identical sums
            total += part
        return tensor.copy_(total)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self.device_group.gather(self.rank, tensor), dim=dim)


def run_threads(world_size: int, model_dir: str) -> list[dict[str, Any]]:
    exchange = _Exchange(world_size)
    with ThreadPoolExecutor(world_size) as pool:
        futures = [
            pool.submit(run_rank, ThreadTPGroup(rank, world_size, exchange), model_dir)
            for rank in range(world_size)
        ]
        return [f.result(timeout=300) for f in futures]
