"""What a quantized matmul costs on this CPU, per backend, against float32 ``F.linear``.

SmolLM2-135M shapes (N, K): fused qkv (960, 576), o (576, 576), gate_up (3072, 576),
down (576, 1536), lm_head (49152, 576); M = 1 (decode) and M = 64 (a prefill chunk).

Decode is memory-bound, and one hot weight matrix sits in cache, so each variant cycles over
``--copies`` distinct weights per shape (a 30-layer model streams 30 of them per step), capped
at ``--max-bytes`` per variant (2 GiB: far above the last-level cache). Each round times one
pass over the copies, timing every call; the table keeps the median call (robust to the
stalls other processes cause on a shared 2-core box; the load average is printed). Slow
variants (first call over 50 ms) take the median of 3 calls on one weight. The summary adds
up one decode step of the whole model: 30 layers of the four layer shapes plus the lm_head.

The error column is the max abs error over max |y| of each variant against the float32
reference (dequantized weight, float64 matmul) at M = 64, (576, 576).

On a box shared with other work, ``--threads 1 --clock thread`` times this thread's CPU
time only: two OpenMP threads stall whole scheduler slices (4 ms) whenever one of them is
preempted, which no statistic over wall times removes.

Usage: ``.venv/bin/python scripts/quant_matmul_cost.py [--copies 30] [--rounds 5]
[--threads 1 --clock thread]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenwire.kernels.quant_matmul import (
    Backend,
    dequantize_w4a16,
    dequantize_w8a16,
    pack_int4,
    prepare_w4a16,
    prepare_w8a16,
    w4a16_matmul,
    w8a16_matmul,
)

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
LAYERS = 30
GROUP_SIZE = 64  # SmolLM2's K = 576 is not a multiple of 128
Call = Callable[[torch.Tensor], torch.Tensor]
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16


@dataclass(frozen=True)
class Variant:
    name: str
    bits: int  # 0: a dense weight (F.linear); 4 or 8: quantized
    x_dtype: torch.dtype
    backend: Backend
    compute_dtype: torch.dtype | None = None


VARIANTS = [
    Variant("fp32 F.linear (baseline)", 0, f32, "dense"),
    Variant("bf16 F.linear", 0, bf16, "dense"),
    Variant("int4 bf16: int4pack", 4, bf16, "int4pack"),
    Variant("int4 bf16: dequant per call", 4, bf16, "dequant"),
    Variant("int4 fp32: cast bf16 -> int4pack", 4, f32, "int4pack", bf16),
    Variant("int4 fp32: int4pack fp32", 4, f32, "int4pack"),
    Variant("int4 fp32: dequant per call", 4, f32, "dequant"),
    Variant("int4 fp32: dense copy", 4, f32, "dense"),
    Variant("int4 fp16: int4pack fp16", 4, f16, "int4pack"),
    Variant("int4 fp16: dense copy", 4, f16, "dense"),
    Variant("int8 bf16: int8pack", 8, bf16, "int8pack"),
    Variant("int8 fp32: int8pack fp32", 8, f32, "int8pack"),
    Variant("int8 fp32: cast bf16 -> int8pack", 8, f32, "int8pack", bf16),
    Variant("int8 fp32: dequant per call", 8, f32, "dequant"),
]


def make_call(v: Variant, n: int, k: int, seed: int) -> tuple[Call, torch.Tensor]:
    """``(matmul with one fresh random weight, its float32 dequantized weight)``."""
    gen = torch.Generator().manual_seed(seed)
    if v.bits == 0:
        weight = torch.randn(n, k, generator=gen) * 0.05
        dense = weight.to(v.x_dtype)
        return (lambda x: F.linear(x, dense)), weight
    if v.bits == 4:
        groups = k // GROUP_SIZE
        qweight = pack_int4(torch.randint(0, 16, (k, n), generator=gen))
        scales = (torch.rand(groups, n, generator=gen) * 0.01 + 0.001).to(v.x_dtype)
        zeros = (torch.rand(groups, n, generator=gen) * 15).to(v.x_dtype)
        w4 = prepare_w4a16(qweight, scales, zeros, None, GROUP_SIZE, "cpu", v.x_dtype,
                           compute_dtype=v.compute_dtype, backend=v.backend)  # fmt: skip
        return (lambda x: w4a16_matmul(x, w4)), dequantize_w4a16(
            qweight, scales, zeros, None, GROUP_SIZE
        )
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, 1, generator=gen) * 0.001).to(v.x_dtype)
    w8 = prepare_w8a16(codes, scale, k, "cpu", v.x_dtype,
                       compute_dtype=v.compute_dtype, backend=v.backend)  # fmt: skip
    return (lambda x: w8a16_matmul(x, w8)), dequantize_w8a16(codes, scale, k)


def time_variant(v: Variant, n: int, k: int, m: int, args: argparse.Namespace) -> float:
    """Median seconds per call, each call on the next of several distinct weights."""
    x = torch.randn(m, k).to(v.x_dtype)
    first, _ = make_call(v, n, k, 0)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if timed(first, x, clock) > 0.05:  # slow and compute-bound: caches do not matter
        return statistics.median(timed(first, x, clock) for _ in range(3))
    copies = max(4, min(args.copies, args.max_bytes // max(1, weight_bytes(v, n, k))))
    calls = [first] + [make_call(v, n, k, seed)[0] for seed in range(1, copies)]
    for call in calls:
        call(x)
    return statistics.median(timed(call, x, clock) for _ in range(args.rounds) for call in calls)


def timed(call: Call, x: torch.Tensor, clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    call(x)
    return clock() - start


def weight_bytes(v: Variant, n: int, k: int) -> int:
    if v.bits == 0 or v.backend == "dense":
        return n * k * (4 if (v.compute_dtype or v.x_dtype) == f32 else 2)
    return n * k * v.bits // 8


def relative_error(v: Variant, m: int = 64, n: int = 576, k: int = 576) -> float:
    call, weight = make_call(v, n, k, 0)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(v.x_dtype)
    ref = x.double() @ weight.double().t()
    return float((call(x).double() - ref).abs().max() / ref.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-bytes", type=int, default=2 << 30)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: this thread's CPU time, blind to preemption (needs --threads 1)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        parser.error("--clock thread needs --threads 1 (other threads' work would not count)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    times: dict[tuple[str, int, tuple[int, int]], float] = {}
    with torch.inference_mode():
        errors = {v.name: relative_error(v) for v in VARIANTS}
        for m in args.m:
            for n, k in SHAPES:
                for v in VARIANTS:
                    times[v.name, m, (n, k)] = time_variant(v, n, k, m, args)
                print_shape(times, m, (n, k))
    print_summary(times, errors, args.m)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


def print_shape(times: dict[tuple[str, int, tuple[int, int]], float], m: int,
                shape: tuple[int, int]) -> None:  # fmt: skip
    base = times[VARIANTS[0].name, m, shape]
    print(f"\nM={m} (N, K)={shape}")
    for v in VARIANTS:
        t = times[v.name, m, shape]
        print(f"  {v.name:36s} {t * 1e6:12.1f} us  {t / base:7.2f}x fp32")


def step_time(times: dict[tuple[str, int, tuple[int, int]], float], name: str, m: int) -> float:
    """One decode step of the whole model: every layer shape 30 times, the lm_head once."""
    layers = sum(times[name, m, shape] for shape in SHAPES[:4])
    return LAYERS * layers + times[name, m, SHAPES[4]]


def print_summary(
    times: dict[tuple[str, int, tuple[int, int]], float], errors: dict[str, float], ms: list[int]
) -> None:
    heads = "".join(f"  step M={m} (ms)    x fp32" for m in ms)
    print(f"\nWhole model, one step: {LAYERS} x (4 layer shapes) + lm_head\n"
          f"{'variant':36s}{heads}  rel err")  # fmt: skip
    for v in VARIANTS:
        row = ""
        for m in ms:
            step, base = step_time(times, v.name, m), step_time(times, VARIANTS[0].name, m)
            row += f"  {step * 1e3:14.2f} {step / base:9.2f}x"
        print(f"{v.name:36s}{row}  {errors[v.name]:.1e}")


if __name__ == "__main__":
    main()
