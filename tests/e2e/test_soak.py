"""A mixed soak against one real ``tokenwire serve`` subprocess (tiny model, loopback): unary,
streaming, session and REST-streaming callers for ``TOKENWIRE_SOAK_SECONDS`` (default 120),
a third of the calls cancelled at random points (seeded RNG), short deadlines, client
disconnects and bad requests. Afterwards, read from outside (``/metrics``, ``psutil``): nothing
running or waiting, KV usage back at 0 with every block free, the server tree's RSS growth
under ``RSS_GROWTH_BOUND``, no INTERNAL / UNKNOWN / 5xx anywhere, and the server still serves.

The summary line (``SOAK ...``) is the figure in docs/soak-and-fault-tests.md:
``TOKENWIRE_SOAK_SECONDS=300 .venv/bin/pytest -s tests/e2e/test_soak.py``. ``make test`` runs
120 s (issue 27: the suite's time budget): the same checks, a leak must be ~2.5x larger per
call to cross the RSS bound.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serve_process import Served, serve
from soak_workers import MODES, WEIGHTS, Tally, rest_stream, session, stream, unary

SOAK_SECONDS = float(os.environ.get("TOKENWIRE_SOAK_SECONDS", "120"))
SEED = 18
KV_BLOCKS = 64  # small enough that the callers press on it (preemption included)
# Measured on a busy 2-core box (docs/soak-and-fault-tests.md), 30 s and 300 s runs: the
# tree's RSS never rose more than 0.7 MiB above its post-warm-up value and ended ~25 MiB below
# it. 64 MiB of margin still catches a leak of ~35 KiB per call over the 300 s run's ~1900
# calls (~85 KiB per call over make test's 120 s, ~750 calls).
RSS_GROWTH_BOUND = 64 * 2**20
IDLE_WITHIN_S = 30.0
# kind -> number of threads; each thread has its own RNG seeded from SEED and its index.
CALLERS = {"unary": 1, "stream": 2, "session": 1, "rest_stream": 2}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(SOAK_SECONDS) + 300)]


@pytest.fixture(scope="module")
def served(tiny_model_with_tokenizer: Path) -> Iterator[Served]:
    server = serve(
        tiny_model_with_tokenizer,
        "--num-gpu-blocks-override",
        str(KV_BLOCKS),
        "--shutdown-timeout",
        "30",
    )
    yield server
    server.proc.terminate()
    assert server.proc.wait(timeout=60) == 0


@dataclass
class Sampler:
    """Samples the gauges and the tree's RSS while the soak runs (the maxima it reports)."""

    served: Served
    stop: threading.Event = field(default_factory=threading.Event)
    max_kv_usage: float = 0.0
    max_running: float = 0.0
    max_waiting: float = 0.0
    max_rss: int = 0
    samples: int = 0

    def run(self) -> None:
        while not self.stop.wait(0.25):  # a sampling period, not a synchronisation
            gauges = self.served.gauges()
            self.max_kv_usage = max(self.max_kv_usage, gauges["tokenwire:kv_cache_usage_perc"])
            self.max_running = max(self.max_running, gauges["tokenwire:num_requests_running"])
            self.max_waiting = max(self.max_waiting, gauges["tokenwire:num_requests_waiting"])
            self.max_rss = max(self.max_rss, self.served.rss_bytes())
            self.samples += 1


def caller(kind: str, index: int, served: Served, tally: Tally, until: float) -> None:
    """One caller thread: calls of ``kind`` in random modes until ``until``."""
    rng = random.Random(f"{SEED}-{kind}-{index}")
    call: Callable[[random.Random, str], str]
    with (
        grpc.insecure_channel(served.target) as channel,
        httpx.Client(base_url=served.rest_url) as http,
    ):
        if kind == "rest_stream":
            model = http.get("/v1/models").json()["data"][0]["id"]
            call = lambda r, mode: rest_stream(r, http, served.rest_url, model, mode)  # noqa: E731
        else:
            fn = {"unary": unary, "stream": stream, "session": session}[kind]
            call = lambda r, mode: fn(r, channel, served.target, mode)  # noqa: E731
        while time.monotonic() < until:
            mode = rng.choices(MODES, WEIGHTS)[0]
            tally.add(kind, mode, call(rng, mode))


def run_callers(served: Served, tally: Tally, seconds: float) -> None:
    until = time.monotonic() + seconds
    threads = [
        threading.Thread(target=caller, args=(kind, i, served, tally, until), name=f"{kind}{i}")
        for kind, count in CALLERS.items()
        for i in range(count)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + 120)
        assert not thread.is_alive(), f"caller {thread.name} hangs"


def wait_idle_gauges(served: Served) -> tuple[dict[str, float], float]:
    """Poll ``/metrics`` until the engine reads idle (bounded); the gauges and seconds taken."""
    started = time.monotonic()
    while True:
        gauges = served.gauges()
        idle = (
            gauges["tokenwire:num_requests_running"] == 0
            and gauges["tokenwire:num_requests_waiting"] == 0
            and gauges["tokenwire:kv_cache_usage_perc"] == 0
            and gauges["tokenwire:kv_cache_free_blocks"] == gauges["tokenwire:kv_cache_num_blocks"]
        )
        waited = time.monotonic() - started
        if idle or waited > IDLE_WITHIN_S:
            return gauges, waited
        time.sleep(0.2)  # polling an outside view with a bound; the assertion is below


def server_statuses(served: Served, since: int = 0) -> Counter[str]:
    """gRPC status of every call the server finished (REST calls pass through gRPC too),
    from its canonical log lines printed after line ``since``."""
    statuses: Counter[str] = Counter()
    for line in list(served.lines)[since:]:
        if '"request_finished"' in line:
            statuses[json.loads(line).get("status", "?")] += 1
    return statuses


def test_soak(served: Served) -> None:
    warmup = Tally()  # one round of every kind first: caches and allocator pools fill up
    run_callers(served, warmup, min(5.0, SOAK_SECONDS / 10))
    assert not warmup.unexpected(), warmup.unexpected()
    rss_before = served.rss_bytes()
    lines_before = len(served.lines)
    sampler = Sampler(served)
    sampling = threading.Thread(target=sampler.run, daemon=True)
    sampling.start()
    tally = Tally()
    started = time.monotonic()
    run_callers(served, tally, SOAK_SECONDS)
    elapsed = time.monotonic() - started
    sampler.stop.set()
    sampling.join(timeout=30)
    gauges, idle_after = wait_idle_gauges(served)
    rss_after = served.rss_bytes()
    statuses = server_statuses(served, lines_before)
    summary = {
        "seconds": round(elapsed, 1),
        "calls": sum(tally.counts.values()),
        "by_kind": dict(tally.by(0)),
        "by_mode": dict(tally.by(1)),
        "by_outcome": dict(tally.by(2)),
        "server_status": dict(statuses),
        "rss_mib_before": round(rss_before / 2**20, 1),
        "rss_mib_after": round(rss_after / 2**20, 1),
        "rss_mib_max": round(sampler.max_rss / 2**20, 1),
        "max_kv_usage": round(sampler.max_kv_usage, 3),
        "max_running": sampler.max_running,
        "max_waiting": sampler.max_waiting,
        "kv_usage_after": gauges["tokenwire:kv_cache_usage_perc"],
        "free_blocks_after": f"{gauges['tokenwire:kv_cache_free_blocks']:.0f}"
        f"/{gauges['tokenwire:kv_cache_num_blocks']:.0f}",
        "idle_after_s": round(idle_after, 2),
        "samples": sampler.samples,
    }
    print(f"\nSOAK {json.dumps(summary)}")
    assert not tally.unexpected(), tally.unexpected()
    assert summary["calls"] > SOAK_SECONDS  # the callers kept it busy (> 1 call per second)
    assert tally.by(1)["cancel"] > 0.25 * summary["calls"]  # a third were cancelled
    # Nothing left behind, read from outside.
    assert gauges["tokenwire:num_requests_running"] == 0
    assert gauges["tokenwire:num_requests_waiting"] == 0
    assert gauges["tokenwire:kv_cache_usage_perc"] == 0.0
    assert gauges["tokenwire:kv_cache_free_blocks"] == gauges["tokenwire:kv_cache_num_blocks"]
    assert gauges["tokenwire:kv_cache_num_blocks"] > 0
    assert sampler.max_kv_usage > 0.1  # the soak really used the KV cache
    # No server-side failure: every call the server logged ended with an expected status.
    assert sum(statuses.values()) > summary["calls"] / 2  # the log check is not vacuous
    assert not {"INTERNAL", "UNKNOWN", "DATA_LOSS"} & set(statuses), statuses
    assert not any('"level": "error"' in line for line in served.lines)
    assert rss_after - rss_before < RSS_GROWTH_BOUND, summary
    # ...and it still serves.
    with grpc.insecure_channel(served.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert unary(random.Random(SEED), channel, served.target, "complete") == "ok"
