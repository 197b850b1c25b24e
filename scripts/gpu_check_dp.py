"""The ``dp`` stage of ``gpu_check.py`` (issue 34): data parallelism, served, two cores vs one.

Needs two GPUs: with fewer than two visible (``torch.cuda.device_count()``) the stage records
``dp`` with ``skipped`` and the reason, and the summary shows it (not a failure). Otherwise,
in one run, ``tokenwire serve`` (the bundled config, dummy bf16 weights) starts as
``--data-parallel-size 1`` and then as ``2`` (core i on ``cuda:i``), and against each:

- the served ``mixed`` workload (256 requests, 256 in flight): output tok/s, recorded as
  ``dp_throughput`` per size;
- ``GREEDY_PROMPTS`` greedy requests one after another (batch 1, so both layouts run the
  same kernels on the same shapes): their token ids. With two cores the first half goes to
  core 0 (the balancer's tie-break: the least loaded, then the lowest rank); then a long
  request holds core 0 and the second half goes to core 1.

Then ``dp``: output tok/s of size 2 over size 1 (target >= 1.8x) and whether the greedy
outputs were equal. ``--smoke``: the same plumbing on the CPU (two engine-core processes,
one torch thread each) with the tiny config and the ``cpu`` workload's 2 requests.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

SCRIPTS = Path(__file__).resolve().parent
SIZES = (1, 2)
GREEDY_PROMPTS = 8
GREEDY_TOKENS = 16
HOLD_TOKENS = 3000  # the request that keeps core 0 busy while core 1 answers
HOLD_ID = "gpu-check-dp-hold"


class Record(Protocol):
    def __call__(self, **record: Any) -> None: ...


def skip_reason(smoke: bool, device_count: Callable[[], int]) -> str:
    """Why the stage cannot run here ('' when it can): two GPUs, or the CPU (``--smoke``)."""
    if smoke:
        return ""
    count = device_count()
    return "" if count >= 2 else f"needs 2 GPUs, {count} visible"


def greedy_prompts(vocab: int) -> list[list[int]]:
    """Distinct prompts (no shared first block: prefix affinity must not pick the core)."""
    return [
        [3 + (101 * i + 7 * j + j * j) % (vocab - 3) for j in range(8 + 5 * i)]
        for i in range(GREEDY_PROMPTS)
    ]


def greedy_answers(client: Any, prompts: list[list[int]], hold_core_0: bool) -> list[list[int]]:
    """Token ids of each prompt, one request at a time; ``hold_core_0``: the second half
    while a long request keeps core 0 busy (so core 1, the least loaded, answers it)."""
    from tokenwire.clients import results

    def ask(ids: list[int]) -> list[int]:
        reply = client.generate(ids, temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
        return list(reply.choices[0].token_ids)

    half = len(prompts) // 2
    answers = [ask(ids) for ids in prompts[:half]]
    if not hold_core_0:
        return answers + [ask(ids) for ids in prompts[half:]]
    hold = client.stream([5, 6, 7], request_id=HOLD_ID, temperature=0.0,
                         max_tokens=HOLD_TOKENS, ignore_eos=True)  # fmt: skip
    next(e for e in hold if isinstance(e, results.TextDelta))  # running on core 0
    try:
        return answers + [ask(ids) for ids in prompts[half:]]
    finally:
        client.cancel(HOLD_ID)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def serve_size(args: argparse.Namespace, size: int) -> dict[str, Any]:
    """Start the server with ``size`` cores, run the workload and the greedy prompts."""
    sys.path.insert(0, str(SCRIPTS))
    from gpu_check_stages import _serve_bench, _serve_command, _wait_serving

    from tokenwire.clients.client import Client

    port = _free_port()
    command = [*_serve_command(args.model, port, args.smoke), "--data-parallel-size", str(size)]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=os.environ.copy(),
    )  # fmt: skip
    try:
        why = _wait_serving(proc, args.ready_timeout)
        if why:
            return {"skipped": f"dp={size}: {why}"[-2000:]}
        summary = _serve_bench(port, args.vocab, args.smoke)
        with Client(f"127.0.0.1:{port}", timeout=120) as client:
            greedy = greedy_answers(client, greedy_prompts(args.vocab), hold_core_0=size > 1)
        return {"summary": summary, "greedy": greedy}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def stage_dp(
    args: argparse.Namespace, record: Record, device_count: Callable[[], int] | None = None
) -> None:
    """``device_count``: how many GPUs are visible (default ``torch.cuda.device_count``)."""
    import torch

    label = args.label or args.model
    why = skip_reason(args.smoke, device_count or torch.cuda.device_count)
    if not why:
        try:  # the server stack needs grpcio, structlog, ...: skip without them
            import tokenwire.clients.client
            import tokenwire.server.serve  # noqa: F401
        except ImportError as exc:
            why = f"{type(exc).__name__}: {exc}"
    if why:
        record(kind="dp", model=label, skipped=why)
        return
    runs: dict[int, dict[str, Any]] = {}
    for size in SIZES:
        runs[size] = serve_size(args, size)
        if "skipped" in runs[size]:
            record(kind="dp", model=label, skipped=runs[size]["skipped"])
            return
        s = runs[size]["summary"]
        record(kind="dp_throughput", model=label, data_parallel_size=size,
               output_tok_s=s["output_throughput"], completed=s["completed"],
               failed=s["failed"], concurrency=s["concurrency"])  # fmt: skip
    one, two = (runs[n]["summary"]["output_throughput"] for n in SIZES)
    record(kind="dp", model=label, output_tok_s_dp1=one, output_tok_s_dp2=two,
           ratio=round(two / one, 3) if one else None,
           greedy_equal=runs[1]["greedy"] == runs[2]["greedy"],
           greedy_prompts=GREEDY_PROMPTS)  # fmt: skip
