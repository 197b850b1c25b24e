#!/usr/bin/env python3
"""What constrained decoding costs (issue 14's figure): output tokens/s with every request
JSON-schema constrained vs free, on the default model at batch 64, in the same run; and the
grammar compile time (front-side parse and core-side compile) for the test schemas.

The constrained run goes first (it also compiles and caches the grammar); each free request
then gets ``max_tokens`` = its constrained twin's output length with EOS ignored, so both
runs produce the same number of tokens from the same prompts. Rounds alternate free /
constrained and the table reports the median of each. Because the forward pass dominates
(and is what a busy machine perturbs), it also reports the engine's own per-step work
outside the forward — schedule (bitmask fill), sampling (mask applied) and update (matchers
advanced) — as the median over full-batch decode steps of each kind of run. Ends with one
JSON line.

    .venv/bin/python scripts/structured_cost.py [--rounds 3] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from tokenwire.bench.structured_schemas import ALL_SCHEMAS
from tokenwire.runtime.front.structured_validate import parse_grammar
from tokenwire.runtime.front.tokenizer import apply_chat_template
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams, StructuredOutputsParams
from tokenwire.runtime.stats import StepRecorder
from tokenwire.runtime.structured.compiler import GrammarCompilerPool

PEOPLE = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 3,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string", "maxLength": 24},
                    "email": {"type": "string", "maxLength": 40},
                },
                "required": ["name", "age", "city", "email"],
            },
        }
    },
    "required": ["people"],
}
CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Quito", "Perth", "Seoul", "Dakar"]


def prompts(llm: LLM, count: int) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [
        apply_chat_template(
            tokenizer,
            [
                {
                    "role": "user",
                    "content": f"List three people who live in {CITIES[i % 8]} (#{i}) as JSON "
                    "with name, age, city and email.",
                }
            ],
        )
        for i in range(count)
    ]


def timed_run(
    llm: LLM, batch: list[list[int]], params: list[SamplingParams], recorder: StepRecorder
) -> tuple[float, int, list[float]]:
    """Seconds, output tokens, and per full-batch decode step the ms spent outside the
    forward (schedule + prepare + sample + update)."""
    recorder.steps.clear()
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)  # type: ignore[arg-type]
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"  run: {tokens} tokens in {seconds:.1f} s", file=sys.stderr, flush=True)
    outside = [
        1e3 * (s.schedule_time + s.prepare_time + s.sample_time + s.update_time)
        for s in recorder.steps
        if s.phase == "decode" and s.num_seqs == len(batch)
    ]
    return seconds, tokens, outside


def throughput(
    llm: LLM, recorder: StepRecorder, batch_size: int, rounds: int, max_tokens: int
) -> dict[str, Any]:
    batch = prompts(llm, batch_size)
    constraint = StructuredOutputsParams(json=PEOPLE)
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint)
    ] * batch_size
    t0 = time.perf_counter()
    warm = llm.generate(batch, constrained, use_tqdm=False)  # type: ignore[arg-type]
    print(f"  warm-up (compiles): {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    lengths = [len(o.outputs[0].token_ids) for o in warm]
    valid = sum(_valid(o.outputs[0].text) for o in warm)
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    free_tok_s, constrained_tok_s = [], []
    free_ms: list[float] = []
    constrained_ms: list[float] = []
    for _ in range(rounds):
        seconds, tokens, outside = timed_run(llm, batch, free, recorder)
        free_tok_s.append(tokens / seconds)
        free_ms.extend(outside)
        seconds, tokens, outside = timed_run(llm, batch, constrained, recorder)
        if tokens != sum(lengths):  # greedy near-ties can flip between runs; tok/s still holds
            print(f"  note: {tokens} constrained tokens vs {sum(lengths)}", file=sys.stderr)
        constrained_tok_s.append(tokens / seconds)
        constrained_ms.extend(outside)
    free_med, con_med = statistics.median(free_tok_s), statistics.median(constrained_tok_s)
    return {
        "batch": batch_size,
        "output_tokens_per_run": sum(lengths),
        "mean_output_len": sum(lengths) / len(lengths),
        "valid_json": f"{valid}/{batch_size}",
        "free_output_tok_s": round(free_med, 1),
        "constrained_output_tok_s": round(con_med, 1),
        "ratio": round(con_med / free_med, 3),
        "free_step_outside_forward_ms": _median_ms(free_ms),
        "constrained_step_outside_forward_ms": _median_ms(constrained_ms),
        "free_rounds": [round(x, 1) for x in free_tok_s],
        "constrained_rounds": [round(x, 1) for x in constrained_tok_s],
    }


def _median_ms(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def _valid(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def compile_times(llm: LLM, repeats: int) -> dict[str, Any]:
    """Milliseconds: the front's parse (validation) and the core's tokenizer compile, each
    schema ``repeats`` times, uncached."""
    facts = llm.engine.facts
    pool = GrammarCompilerPool(facts.tokenizer_path, facts.vocab_size, facts.eos_token_ids)
    specs = [StructuredOutputsParams(json=s).spec() for s in [*ALL_SCHEMAS.values(), PEOPLE]]
    pool._get_compiler()  # the tokenizer's vocabulary, once (not a per-schema cost)
    parse_ms, compile_ms = [], []
    for spec in specs:
        for _ in range(repeats):
            t0 = time.perf_counter()
            parse_grammar(spec)
            t1 = time.perf_counter()
            pool._compile(spec)
            t2 = time.perf_counter()
            parse_ms.append(1e3 * (t1 - t0))
            compile_ms.append(1e3 * (t2 - t1))
    pool.shutdown()
    return {
        "schemas": len(specs),
        "samples": len(compile_ms),
        "parse_p50_ms": round(_percentile(parse_ms, 0.5), 2),
        "parse_p99_ms": round(_percentile(parse_ms, 0.99), 2),
        "compile_p50_ms": round(_percentile(compile_ms, 0.5), 2),
        "compile_p99_ms": round(_percentile(compile_ms, 0.99), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--compile-repeats", type=int, default=10)
    args = parser.parse_args()
    recorder = StepRecorder()
    llm = LLM(
        None,
        observer=recorder,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, 64 * args.batch),
        max_model_len=1024,
        # Every run prefills its prompts the same way (a cache hit would change the
        # arithmetic of later runs, and so greedy near-ties).
        enable_prefix_caching=False,
    )
    result = throughput(llm, recorder, args.batch, args.rounds, args.max_tokens)
    compiled = compile_times(llm, args.compile_repeats)
    device = llm.engine.facts.device
    print(f"structured outputs on {llm.engine.facts.served_model_name} ({device})")
    print(f"  batch {result['batch']}, {result['output_tokens_per_run']} output tokens per run")
    print(f"  free        {result['free_output_tok_s']:>8.1f} output tok/s (median)")
    print(f"  constrained {result['constrained_output_tok_s']:>8.1f} output tok/s (median)")
    print(f"  ratio       {result['ratio']:>8.3f}   valid JSON {result['valid_json']}")
    print(
        "  per full-batch decode step outside the forward (median ms): "
        f"free {result['free_step_outside_forward_ms']}, "
        f"constrained {result['constrained_step_outside_forward_ms']}"
    )
    print(
        f"  compile ({compiled['schemas']} schemas x {args.compile_repeats}): "
        f"parse p50 {compiled['parse_p50_ms']} ms p99 {compiled['parse_p99_ms']} ms, "
        f"compile p50 {compiled['compile_p50_ms']} ms p99 {compiled['compile_p99_ms']} ms"
    )
    record = {"bench": "structured_cost", "device": device, **result, **compiled}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
