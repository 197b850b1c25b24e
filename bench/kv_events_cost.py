"""``tokenwire bench overhead --compare-kv-events``: the cost of KV-cache events per step.

Runs the overhead workload with events off and on (``publisher: null``: the core records
and the front drains every step, as served), ``rounds`` times in one process in ABBA order,
and
compares median step times. The cost is the step-time difference plus the msgspec encoding
of the batches (which the step timings do not contain), as a fraction of the step time off.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Any

from tokenwire.bench.configs import OverheadConfig
from tokenwire.bench.overhead import overhead_result
from tokenwire.runtime.kv_events_config import KVEventsConfig

EVENTS_ON = KVEventsConfig(enable_kv_cache_events=True, publisher="null")


def kv_events_cost(config: OverheadConfig, rounds: int = 3) -> dict[str, Any]:
    on_config = dataclasses.replace(
        config, engine=dataclasses.replace(config.engine, kv_events_config=EVENTS_ON)
    )
    off: list[dict[str, Any]] = []
    on: list[dict[str, Any]] = []
    for i in range(rounds):  # ABBA order: neither setting always runs first
        if i % 2:
            on.append(overhead_result(on_config))
            off.append(overhead_result(config))
        else:
            off.append(overhead_result(config))
            on.append(overhead_result(on_config))
    step_off = statistics.median(r["step_ms"] for r in off)
    step_on = statistics.median(r["step_ms"] for r in on)
    book_off = statistics.median(r["engine_overhead_ms_per_step"] for r in off)
    book_on = statistics.median(r["engine_overhead_ms_per_step"] for r in on)
    encode = statistics.median(r["kv_events_encode_ms_per_step"] for r in on)
    cost = book_on - book_off + encode  # may come out negative: noise is larger
    return {
        "bench": "overhead_kv_events",
        "num_seqs": off[0]["num_seqs"],
        "rounds": rounds,
        "step_ms_events_off": round(step_off, 3),
        "step_ms_events_on": round(step_on, 3),
        "kv_events_encode_ms_per_step": encode,
        "kv_events_cost_ms_per_step": round(cost, 4),
        "kv_events_cost_fraction": round(cost / step_off, 5),
        "overhead_ms_events_off": book_off,
        "overhead_ms_events_on": book_on,
        "forward_ms_events_off": statistics.median(r["forward_ms"] for r in off),
        "forward_ms_events_on": statistics.median(r["forward_ms"] for r in on),
    }


def run_kv_events_cost(config: OverheadConfig, rounds: int) -> int:
    result = kv_events_cost(config, rounds)
    print(f"\nKV-event cost with {result['num_seqs']} running sequences ({rounds} rounds):")
    for key, value in result.items():
        if key not in ("bench", "num_seqs", "rounds"):
            print(f"  {key:32s} {value}")
    print(json.dumps(result))
    return 0
