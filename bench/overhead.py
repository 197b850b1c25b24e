"""``tokenwire bench overhead``: the engine's own bookkeeping per step (schedule + input
preparation + update), measured with many running sequences on a model whose forward pass is
nearly free (a tiny random Llama unless a model is given)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from tokenwire.bench.configs import OverheadConfig
from tokenwire.bench.throughput import build_llm, overhead_ms
from tokenwire.runtime.engine_args import flag_of
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder, StepStats

# A tiny Llama for measuring engine bookkeeping, where the forward pass is nearly free.
TINY_OVERHEAD_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPT_LEN = 32


def overhead_result(config: OverheadConfig) -> dict[str, Any]:
    engine = config.engine
    num_seqs = engine.max_num_seqs if config.num_seqs is None else config.num_seqs
    if num_seqs > engine.max_num_seqs:
        raise ValueError(
            f"--num-seqs {num_seqs} cannot all run: raise {flag_of('max_num_seqs')} "
            f"(now {engine.max_num_seqs})"
        )
    recorder = StepRecorder()
    with tempfile.TemporaryDirectory() as tmp:
        if engine.model is None:
            (Path(tmp) / "config.json").write_text(json.dumps(TINY_OVERHEAD_CONFIG))
            engine = dataclasses.replace(engine, model=tmp, load_format="dummy")
        llm = build_llm(engine, recorder)
        vocab = llm.engine.vocab_size
        span = min(1000, vocab - 3)
        prompts = [[(7 * i + j) % span + 3 for j in range(PROMPT_LEN)] for i in range(num_seqs)]
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=config.output_len)
        llm.generate(prompts, params, use_tqdm=False)
        encode_s = _encode_time(llm.kv_events)
        del llm
    full = [s for s in recorder.steps if s.num_seqs == num_seqs and s.phase == "decode"]
    if not full:
        raise ValueError(
            f"no decode step ran all {num_seqs} sequences at once: raise --output-len or "
            f"the KV cache ({flag_of('kv_cache_memory')})"
        )
    return {
        "bench": "overhead",
        "num_seqs": num_seqs,
        "decode_steps": len(full),
        "engine_overhead_ms_per_step": round(overhead_ms(full), 3),
        "schedule_ms": round(1e3 * statistics.median(s.schedule_time for s in full), 3),
        "prepare_ms": round(1e3 * statistics.median(s.prepare_time for s in full), 3),
        "update_ms": round(1e3 * statistics.median(s.update_time for s in full), 3),
        "forward_ms": round(1e3 * statistics.median(s.forward_time for s in full), 3),
        "sample_ms": round(1e3 * statistics.median(s.sample_time for s in full), 3),
        "step_ms": round(1e3 * statistics.median(s.duration for s in full), 3),
        "step_interval_ms": round(_interval_ms(full), 3),
        "kv_events_encode_ms_per_step": round(1e3 * encode_s / len(recorder.steps), 4),
    }


def _interval_ms(steps: list[StepStats]) -> float:
    """Median time between the starts of consecutive steps of ``steps`` (the loop's period:
    the critical path of a step, bookkeeping included unless it overlaps the forward)."""
    ordered = sorted(steps, key=lambda s: s.step_id)
    gaps = [
        (b.started_at_ns - a.started_at_ns) / 1e6
        for a, b in itertools.pairwise(ordered)
        if b.step_id == a.step_id + 1
    ]
    return statistics.median(gaps) if gaps else float("nan")


def _encode_time(batches: Any) -> float:
    """Seconds msgspec takes to encode every recorded KV-event batch (what the core process
    adds to its StepResult, and the ZMQ publisher thread again); 0 with events off."""
    if not batches:
        return 0.0
    encoder = msgspec.msgpack.Encoder()
    t0 = time.perf_counter()
    for batch in batches:
        encoder.encode(batch)
    return time.perf_counter() - t0


def run_overhead(config: OverheadConfig) -> int:
    result = overhead_result(config)
    model = config.engine.model or "tiny model"
    print(
        f"\nengine overhead with {result['num_seqs']} running sequences ({model}, median of "
        f"{result['decode_steps']} decode steps):"
    )
    for key in (
        "schedule_ms",
        "prepare_ms",
        "update_ms",
        "engine_overhead_ms_per_step",
        "forward_ms",
        "sample_ms",
    ):
        print(f"  {key:30s} {result[key]:8.3f}")
    print(json.dumps(result))
    return 0
