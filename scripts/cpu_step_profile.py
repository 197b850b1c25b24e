"""Where one CPU decode step of the default model goes, part by part (issue 42).

Runs the offline engine (``LLM().generate``, greedy, EOS ignored) on ``--streams`` prompts of
``--prompt-len`` tokens for ``--max-tokens`` tokens, with a timer around each part of a step
(functions and methods wrapped for the run, restored after). Only decode steps (every row a
single-token query) are kept; each part is the mean per decode step, exclusive of the parts
nested inside it:

- ``lm_head``: ``compute_logits`` (the tied 49152 x 576 head and the cast to float32);
- ``linears``: the decoder's qkv / o / gate_up / down projections (int4 kernel, or a dense
  copy);
- ``attention``: ``paged_attention`` over the paged cache; ``store_kv``: the cache write;
- ``norms`` / ``rotary`` / ``activation`` / ``embedding``;
- ``model_python``: the rest of the model's forward (the layer loop, views, residuals);
- ``sampler``: ``sample_rows``; ``runner_prep``: the model runner's input preparation;
- ``scheduler``: the core's schedule + update; ``front``: the front's output processing
  (detokenizing, stop checks). The offline engine has no IPC: served, the core's outputs
  also cross a ZMQ socket (``docs/benchmarks.md``, engine core process vs thread).

``--clock thread`` (default, with ``--threads 1``) times this thread's CPU time, which
other processes on a shared box do not inflate; ``--clock wall`` times wall time. The timers
themselves cost ~1 us per wrapped call (~600 calls a step), charged to the enclosing part;
``tok/s`` comes from an untimed run of the same generate call. ``--variant`` loads the
engine with extra ``LLM`` keywords (JSON), so two configurations can be profiled in one
interleaved run: ``--variant '{}' --variant '{"dtype": "float32"}'``.

    .venv/bin/python scripts/cpu_step_profile.py [--streams 1,16] [--rounds 2]
        [--threads 1] [--clock thread|wall] [--chat] [--variant JSON ...]

``--no-parts``: no timers inside the step (a ``cpu_compile`` forward must stay one graph):
``step_ms`` is the whole generate's clock time divided by ``--max-tokens``, prefill included.

``--chat``: chat prompts ("Tell me about <topic>.", 16 topics) instead of ``--prompt-len``
synthetic token ids; the greedy agreement lines are then over real text.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

PARTS = (
    "lm_head",
    "linears",
    "attention",
    "store_kv",
    "norms",
    "rotary",
    "activation",
    "embedding",
    "model_python",
    "sampler",
    "runner_prep",
    "scheduler",
    "front",
)


@dataclass
class StepTimer:
    """Exclusive time per part for the current step; finished decode steps in ``steps``."""

    clock: Callable[[], int]
    current: dict[str, int] = field(default_factory=dict)
    stack: list[list[int]] = field(default_factory=list)  # [start, nested time] per open part
    decode: bool = False
    steps: list[dict[str, int]] = field(default_factory=list)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its exclusive time added to ``part``."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [self.clock(), 0]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                total = self.clock() - frame[0]
                self.current[part] = self.current.get(part, 0) + total - frame[1]
                if self.stack:
                    self.stack[-1][1] += total

        return timed

    def end_step(self) -> None:
        if self.decode:
            self.steps.append(self.current)
        self.current, self.decode = {}, False


def _patch_points(timer: StepTimer, llm: Any) -> list[tuple[Any, str, str]]:
    """(owner, attribute, part) for every function or method this run wraps."""
    from tokenwire.runtime.engine import core
    from tokenwire.runtime.front import frontend
    from tokenwire.runtime.models import decoder, llama
    from tokenwire.runtime.models.layers import parallel
    from tokenwire.runtime.models.layers.basic import RMSNorm
    from tokenwire.runtime.worker import model_runner

    points = [
        (llama.LlamaForCausalLM, "compute_logits", "lm_head"),
        (llama.LlamaForCausalLM, "forward", "model_python"),
        (llama.LlamaModel, "embed", "embedding"),
        (parallel._ColumnLinear, "forward", "linears"),
        (parallel.RowParallelLinear, "forward", "linears"),
        (decoder, "paged_attention", "attention"),
        (decoder, "store_kv", "store_kv"),
        (decoder, "apply_rotary", "rotary"),
        (RMSNorm, "forward", "norms"),
        (RMSNorm, "add_and_norm", "norms"),
        (model_runner, "sample_rows", "sampler"),
        (model_runner.ModelRunner, "execute_model", "runner_prep"),
        (core.EngineCore, "step", "scheduler"),
        (frontend.Frontend, "process", "front"),
    ]
    for module in llm.engine.executor.worker.runner.model.modules():  # per-instance callables
        if isinstance(module, decoder.MLP):
            points.append((module, "act_and_mul", "activation"))
    return points


@contextmanager
def instrumented(llm: Any, timer: StepTimer) -> Iterator[None]:
    """Every patch point wrapped by ``timer`` for the duration; the LLM's step closes steps."""
    from tokenwire.runtime.models import llama

    points = _patch_points(timer, llm)
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in points]
    for owner, name, part in points:
        setattr(owner, name, timer.wrap(part, getattr(owner, name)))
    forward = llama.LlamaForCausalLM.forward

    def mark(self: Any, input_ids: Any, positions: Any, kv: Any, meta: Any, *rest: Any) -> Any:
        timer.decode = meta.num_decodes == len(meta.query_start_loc_np) - 1
        return forward(self, input_ids, positions, kv, meta, *rest)

    llama.LlamaForCausalLM.forward = mark  # type: ignore[method-assign,assignment]
    step = llm._step

    def step_then_mark() -> Any:
        out = step()
        timer.end_step()
        return out

    llm._step = step_then_mark
    try:
        yield
    finally:
        del llm._step
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


TOPICS = (
    "copper", "dragons", "cats", "the sea", "the sky", "airplanes", "Paris", "volcanoes",
    "bees", "chess", "rain", "trains", "bread", "the moon", "glass", "rivers",
)  # fmt: skip


def _prompts(llm: Any, streams: int, prompt_len: int, chat: bool) -> list[list[int]]:
    """``streams`` synthetic prompts of ``prompt_len`` token ids, or with ``chat`` the chat
    prompts "Tell me about <topic>." (cycling over 16 topics)."""
    if not chat:
        return [[100 + (7 * i + 13 * j) % 20000 for j in range(prompt_len)] for i in range(streams)]
    from tokenwire.runtime.front.tokenizer import apply_chat_template

    tok = llm.get_tokenizer()
    say = [f"Tell me about {TOPICS[i % len(TOPICS)]}." for i in range(streams)]
    return [apply_chat_template(tok, [{"role": "user", "content": s}]) for s in say]


def _child(variant: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    from tokenwire.runtime.llm import LLM
    from tokenwire.runtime.sampling_params import SamplingParams

    clock = time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns
    llm = LLM(max_model_len=512, num_gpu_blocks_override=600, **variant)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    result: dict[str, Any] = {"variant": variant, "threads": args.threads, "clock": args.clock}
    for streams in args.streams:
        prompts = _prompts(llm, streams, args.prompt_len, args.chat)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        timer = StepTimer(clock)
        if args.no_parts:  # the whole generate on the clock, per step (prefill included)
            begin = clock()
            llm.generate(prompts, params, use_tqdm=False)
            timer.steps = [{"step": clock() - begin}]
            ms = {"step": timer.steps[0]["step"] / args.max_tokens / 1e6}
        else:
            with instrumented(llm, timer):
                llm.generate(prompts, params, use_tqdm=False)
            ms = {p: sum(s.get(p, 0) for s in timer.steps) / len(timer.steps) / 1e6 for p in PARTS}
        result[str(streams)] = {
            "tok_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / wall, 2),
            "decode_steps": None if args.no_parts else len(timer.steps),
            "step_ms": round(sum(ms.values()), 3),
            "parts_ms": {p: round(v, 3) for p, v in ms.items()},
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
        }
    return result


def _table(runs: list[dict[str, Any]], streams: int) -> str:
    """Markdown: one row per part, one column per variant (medians over rounds)."""
    names = sorted({json.dumps(r["variant"]) for r in runs})
    per = {n: [r[str(streams)] for r in runs if json.dumps(r["variant"]) == n] for n in names}
    head = f"| part ({streams} stream{'s' if streams > 1 else ''}), ms / decode step | "
    lines = [head + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for part in PARTS:
        cells = [statistics.median(x["parts_ms"].get(part, 0.0) for x in per[n]) for n in names]
        if not any(cells):  # --no-parts: no per-part timers ran
            continue
        lines.append(f"| {part} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    for key in ("step_ms", "tok_s"):
        cells = [statistics.median(x[key] for x in per[n]) for n in names]
        lines.append(f"| **{key}** | " + " | ".join(f"**{c:.2f}**" for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chat", action="store_true", help="chat prompts, not token ids")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    parser.add_argument(
        "--no-parts",
        action="store_true",
        help="no per-part timers (they would split a compiled forward): the whole generate's "
        "clock time per output token, prefill included",
    )
    parser.add_argument("--variant", action="append", type=json.loads, help="LLM kwargs, JSON")
    parser.add_argument("--child", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_child(args.child, args)))
        return
    variants = args.variant or [{}]
    runs: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        for variant in variants:  # interleaved, each in its own process
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", json.dumps(variant)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            run = json.loads(out.strip().splitlines()[-1])
            run["loadavg_1m"] = round(os.getloadavg()[0], 2)
            runs.append(run)
            brief = {k: v for k, v in run.items() if k not in map(str, args.streams)}
            brief |= {s: {k: run[str(s)][k] for k in ("tok_s", "step_ms")} for s in args.streams}
            print(json.dumps(brief), flush=True)
    for streams in args.streams:
        print(_table(runs, streams))
        _agreement(runs, variants, streams)
    print(f"load average (1, 5, 15 min): {os.getloadavg()}")


def _agreement(runs: list[dict[str, Any]], variants: list[dict[str, Any]], streams: int) -> None:
    """Greedy tokens of each variant against the first one: equal tokens before the first
    difference, per prompt (first round)."""
    first = {json.dumps(r["variant"]): r[str(streams)]["tokens"] for r in runs[: len(variants)]}
    base = first[json.dumps(variants[0])]
    for name, toks in first.items():
        prefix = [
            next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
            for x, y in zip(base, toks, strict=True)
        ]
        print(
            f"{name}: tokens equal to {json.dumps(variants[0])} before the first "
            f"difference, per prompt: {prefix}"
        )


if __name__ == "__main__":
    main()
