"""Per-request timings and the ``vllm bench serve`` metric set computed from them.

Times are ``time.perf_counter`` seconds; reported latencies are milliseconds. TTFT is the
first streamed token; ITL the gaps between streamed chunks; TPOT the mean time per output
token after the first; E2EL the whole request.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RequestResult:
    start: float
    end: float
    prompt_len: int
    chunks: list[tuple[float, int]]  # (arrival time, tokens in the chunk)
    error: str | None = None
    reported_output_tokens: int | None = None  # from the server's usage, when it sends one

    @property
    def output_tokens(self) -> int:
        if self.reported_output_tokens is not None:
            return self.reported_output_tokens
        return sum(count for _, count in self.chunks)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [1e3 * s for s in seconds]
    return {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else math.nan,
        f"median_{name}_ms": percentile(ms, 50),
        f"p99_{name}_ms": percentile(ms, 99),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    # Done: no error and tokens seen, as text chunks or in the usage report (a server may hold
    # back text that is not yet valid UTF-8 and stream empty chunks: llama-server does).
    done = [r for r in results if r.error is None and (r.chunks or r.reported_output_tokens)]
    timed = [r for r in done if r.chunks]  # the latency figures need an arrival time
    ttft = [r.chunks[0][0] - r.start for r in timed]
    e2el = [r.end - r.start for r in done]
    itl = [b[0] - a[0] for r in timed for a, b in zip(r.chunks, r.chunks[1:], strict=False)]
    tpot = [
        (r.end - r.start - (r.chunks[0][0] - r.start)) / (r.output_tokens - 1)
        for r in timed
        if r.output_tokens > 1
    ]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration": duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        summary.update(_stats(name, values))
    return summary
