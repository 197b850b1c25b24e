"""``tokenwire bench overhead --compare-async``: how much of the core's bookkeeping async
scheduling takes off the critical path (issue 43).

Runs the overhead workload with ``--no-async-scheduling`` and ``--async-scheduling``,
``rounds`` times in one process in ABBA order. A step's critical path is the interval between
the starts of consecutive full decode steps (the loop's period). Synchronously it holds the
bookkeeping (schedule + input preparation + update) and the forward; with async steps the
schedule and the update of step *k* overlap the forward of step *k+1*. What of a step's
interval is not its forward or sampling is bookkeeping left on the critical path
(``exposed``); the share taken off is ``1 - exposed async / exposed sync``: 1.0 when all of it
is hidden, 0 when none, negative when async adds to it. Subtracting each variant's own forward
keeps a forward that runs slower in one variant (threads sharing the cores) out of the share.
Bookkeeping can only hide behind a forward at least as long as it, so pass a model (or
``--num-seqs``) whose forward is not free.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Any

from tokenwire.bench.configs import OverheadConfig
from tokenwire.bench.overhead import overhead_result


def async_overlap(config: OverheadConfig, rounds: int = 3) -> dict[str, Any]:
    def variant(on: bool) -> OverheadConfig:
        return dataclasses.replace(
            config, engine=dataclasses.replace(config.engine, async_scheduling=on)
        )

    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for i in range(rounds):  # ABBA order: neither setting always runs first
        for on in (True, False) if i % 2 else (False, True):
            runs[on].append(overhead_result(variant(on)))

    def median(on: bool, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[on]))

    interval_sync, interval_async = (
        median(False, "step_interval_ms"),
        median(True, "step_interval_ms"),
    )
    book_sync = median(False, "engine_overhead_ms_per_step")
    exposed_sync = interval_sync - median(False, "forward_ms") - median(False, "sample_ms")
    exposed_async = interval_async - median(True, "forward_ms") - median(True, "sample_ms")
    return {
        "bench": "overhead_async",
        "num_seqs": runs[False][0]["num_seqs"],
        "rounds": rounds,
        "step_interval_ms_sync": round(interval_sync, 3),
        "step_interval_ms_async": round(interval_async, 3),
        "overhead_ms_sync": round(book_sync, 3),
        "forward_ms_sync": round(median(False, "forward_ms"), 3),
        "forward_ms_async": round(median(True, "forward_ms"), 3),
        "exposed_ms_sync": round(exposed_sync, 3),
        "exposed_ms_async": round(exposed_async, 3),
        "hidden_share": round(1 - exposed_async / exposed_sync, 3),
    }


def run_async_overlap(config: OverheadConfig, rounds: int) -> int:
    result = async_overlap(config, rounds)
    print(f"\nasync scheduling with {result['num_seqs']} running sequences ({rounds} rounds):")
    for key, value in result.items():
        if key not in ("bench", "num_seqs", "rounds"):
            print(f"  {key:28s} {value}")
    print(json.dumps(result))
    return 0
