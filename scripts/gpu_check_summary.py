"""The summary of ``gpu_check.py``: issue 6's figures next to their targets and references.

Each row: figure, measured value, target, reference (the H200 floor or HF's static batch
measured in the same run) and a verdict: ``pass``, ``MISS`` (measured, below target) or
``n/a`` (not measured: the stage failed, timed out or was skipped; see the stage table).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

# Issue 6's targets (H200, bf16, dummy weights, greedy, ignore_eos).
MIXED_TARGET_TOK_S = {"llama-3.2-1b": 36_000, "qwen3-0.6b": 18_000, "llama-3.1-8b": 9_000}
HF_RATIO_TARGET = {"llama-3.2-1b": 8.0, "llama-3.1-8b": 3.5}
TPOT_TARGET_MS = {"llama-3.2-1b": 1.5, "llama-3.1-8b": 5.0}
ATTN_FRACTION_TARGET = 0.70
SERVE_RATIO_TARGET = 0.90
FP8_TPOT_SPEEDUP_TARGET = 1.4  # issue 13: FP8 weights >= 1.4x bf16 decode at batch 1
LORA_RATIO_TARGET = 0.8  # issue 15: 4 adapters mixed keep >= 80% of the base's tok/s
SPEC_TARGET = 1.7  # issue 16: n-gram speculation at one stream
SPEC_FLOOR = 0.95  # issue 16: at many streams it must not lose more than 5%
EMBED_COSINE_TARGET = 0.99  # issue 34: tokenwire's vectors against HF's, bf16
DP_RATIO_TARGET = 1.8  # issue 34: --data-parallel-size 2 over 1, served mixed


class StageLike(Protocol):
    name: str
    status: str
    seconds: float
    detail: str
    records: list[dict[str, Any]]


def _row(
    figure: str, value: float | None, target: str, ref: str, ok: bool | None, unit: str = ""
) -> dict[str, Any]:
    verdict = "n/a" if value is None or ok is None else ("pass" if ok else "MISS")
    shown = "-" if value is None else f"{value:,.2f}{unit}"
    return {"figure": figure, "value": value, "shown": shown, "target": target, "reference": ref,
            "verdict": verdict}  # fmt: skip


def _find(stages: Sequence[StageLike], kind: str, **match: Any) -> dict[str, Any] | None:
    for s in stages:
        for r in s.records:
            if r.get("kind") == kind and all(r.get(k) == v for k, v in match.items()):
                return r
    return None


def _bench_rows(stages: Sequence[StageLike], model: str, label: str) -> list[dict[str, Any]]:
    """Rows of one bench stage; ``model`` as recorded (a path for --smoke), ``label`` shown."""
    rows = []
    mixed = _find(stages, "throughput", model=model, workload="mixed")
    target = MIXED_TARGET_TOK_S.get(label)
    value = mixed["output_tok_s"] if mixed else None
    floor = mixed["floor_output_tok_s"] if mixed else None
    ref = f"floor {floor:,.0f} ({value / floor:.0%})" if value and floor else "-"
    ok = None if value is None or target is None else value >= target
    rows.append(_row(f"mixed {label} output tok/s", value, f">= {target or '-'}", ref, ok))
    fixed = _find(stages, "throughput", model=model, workload="fixed")
    hf = _find(stages, "hf_static", model=model)
    if fixed or hf or label in HF_RATIO_TARGET:
        ratio = fixed["output_tok_s"] / hf["output_tok_s"] if fixed and hf else None
        want = HF_RATIO_TARGET.get(label)
        ref = f"HF static b{hf['batch']} {hf['output_tok_s']:,.0f} tok/s" if hf else "-"
        ok = None if ratio is None or want is None else ratio >= want
        rows.append(_row(f"fixed {label} vs HF static", ratio, f">= {want or '-'}x", ref, ok, "x"))
    tpot = _find(stages, "tpot", model=model)
    want_ms = TPOT_TARGET_MS.get(label)
    if tpot or want_ms:
        value = tpot["tpot_ms"] if tpot else None
        floor_ms = tpot.get("tpot_floor_ms") if tpot else None  # null: device not in the table
        weights = tpot.get("weight_bytes_batch1") if tpot else None  # active bytes (MoE)
        ref = f"floor {floor_ms:.2f} ms" if floor_ms else "-"
        ref += f" ({weights / 1e9:.3g} GB/step)" if weights else ""
        ok = None if value is None or want_ms is None else value <= want_ms
        rows.append(_row(f"TPOT batch 1 {label} (ms)", value, f"<= {want_ms or '-'}", ref, ok))
    return rows


def summary_rows(stages: Sequence[StageLike]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for s in stages:
        if s.name.startswith("kernels"):
            rows.append(_row(f"{s.name} tests", None, "all pass", s.detail or "-", None))
            rows[-1]["verdict"] = "pass" if s.status == "ok" else s.status
        for r in s.records:
            if "check" in r:
                rows.append(_row(r["check"], None, "equal", "-", None))
                rows[-1]["verdict"] = "pass" if r["ok"] else "FAIL"
    attn = _find(stages, "attn_bw")
    value = attn.get("fraction") if attn else None
    ok = None if value is None else value >= ATTN_FRACTION_TARGET
    ref = f"{attn['tb_s']} TB/s in {attn['ms']} ms" if attn and "ms" in attn else "-"
    # Of the roofline table's bandwidth for the device (H200: the measured 4.25 TB/s).
    peak = f"{attn['peak_tb_s']:g} TB/s" if attn and attn.get("peak_tb_s") else "peak"
    rows.append(_row(f"decode attention b256 ctx1024 8B, of {peak}", value, ">= 0.70", ref, ok))
    for s in stages:
        if s.name.startswith("bench:"):
            label = s.name.split(":")[1]
            rows += _bench_rows([s], _model_key(s, label), label)
    rows += _lora_rows(stages)
    rows += _spec_rows(stages)
    rows += _vlm_rows(stages)
    rows += _kvtier_rows(stages)
    rows += _embed_rows(stages)
    rows += _dp_rows(stages)
    rows.append(_serve_row(stages))
    rows += _quant_rows(stages)
    rows += _async_rows(stages)
    return rows


def _embed_rows(stages: Sequence[StageLike]) -> list[dict[str, Any]]:
    """Issue 34: embeddings/s of tokenwire over HF's forward (a figure), vectors' cosine."""
    rows: list[dict[str, Any]] = []
    for s in (s for s in stages if s.name.startswith("embed:")):
        label, run = s.name.split(":")[1], _find([s], "embed_throughput")
        ref = "-" if run is None else (
            f"{run['tokenwire_emb_s']:,.0f} vs HF {run['hf_emb_s']:,.0f} emb/s "
            f"({run['tokenwire_tok_s']:,.0f} vs {run['hf_tok_s']:,.0f} input tok/s), "
            f"{run['requests']} x {run['input_tokens']} tokens"
        )  # fmt: skip
        value = None if run is None else run["ratio"]
        rows.append(_row(f"embeddings {label} tokenwire / HF", value, "-", ref, None, "x"))
        if run is not None:
            rows[-1]["verdict"] = "figure"
        match = _find([s], "embed_match")
        value = None if match is None else match["min_cosine"]
        ok = None if value is None else value > EMBED_COSINE_TARGET
        ref = "-" if match is None else f"min over {match['inputs']} inputs"
        rows.append(_row(f"embeddings {label} cosine vs HF", value, "> 0.99", ref, ok))
    return rows


def _dp_rows(stages: Sequence[StageLike]) -> list[dict[str, Any]]:
    """Issue 34: served mixed tok/s with two data-parallel cores over one (>= 1.8x), greedy
    outputs equal; with fewer than two GPUs the stage's skip and its reason."""
    rows: list[dict[str, Any]] = []
    for s in (s for s in stages if s.name.startswith("dp:")):
        label, dp = s.name.split(":")[1], _find([s], "dp")
        value = None if dp is None else dp.get("ratio")
        ref = "-" if value is None or dp is None else (
            f"{dp['output_tok_s_dp2']:,.0f} vs {dp['output_tok_s_dp1']:,.0f} out tok/s"
        )  # fmt: skip
        ok = None if value is None else value >= DP_RATIO_TARGET
        figure = f"DP 2 / 1 mixed tok/s, {label}"
        rows.append(_row(figure, value, f">= {DP_RATIO_TARGET}", ref, ok, "x"))
        if dp is not None and "skipped" in dp:
            rows[-1]["verdict"] = f"skipped: {dp['skipped'][:120]}"
        elif dp is not None:
            rows.append(_row(f"DP {label} greedy dp=2 == dp=1", None, "equal", "-", None))
            rows[-1]["verdict"] = "pass" if dp["greedy_equal"] else "FAIL"
    return rows


def _async_rows(stages: Sequence[StageLike]) -> list[dict[str, Any]]:
    """Issue 43: async scheduling on vs off on the 1B (mixed tok/s and batch-1 TPOT): the
    figures the ``--async-scheduling`` default is decided by (no target: a decision)."""
    rows, base = [], "llama-3.2-1b"
    for kind, key, name in (
        ("throughput", "output_tok_s", "mixed tok/s"),
        ("tpot", "tpot_ms", "TPOT b1"),
    ):
        match = {"workload": "mixed"} if kind == "throughput" else {}
        sync = _find(stages, kind, model=base, **match)
        on = _find(stages, kind, model=f"{base}+async", **match)
        if not (sync or on):
            continue
        ratio = on[key] / sync[key] if sync and on else None
        ref = f"sync {sync[key]:g}" if sync else "-"
        rows.append(_row(f"{name} 1B async / sync", ratio, "decide", ref, None, "x"))
    return rows


def _lora_rows(stages: Sequence[StageLike]) -> list[dict[str, Any]]:
    """Issue 15: throughput with 4 adapters mixed over the base alone (target >= 0.8)."""
    rows = []
    for s in stages:
        if not s.name.startswith("lora:"):
            continue
        r = _find([s], "lora")
        value = r["ratio"] if r else None
        ok = None if value is None else value >= LORA_RATIO_TARGET
        ref = f"base {r['base_output_tok_s']} tok/s" if r else "-"
        label = s.name.split(":")[1]
        rows.append(_row(f"LoRA x4 mixed / base, {label}", value, f">= {LORA_RATIO_TARGET}",
                         ref, ok, "x"))  # fmt: skip
        # Issue 34 item 4: decode graphs with LoRA vs enforce_eager (no hard target).
        g = _find([s], "lora_graphs")
        ref = f"eager {g['eager_mixed_output_tok_s']} tok/s" if g else "-"
        rows.append(_row(f"LoRA graphs / eager, {label}", g["ratio"] if g else None,
                         ">= 1.0 expected", ref, None, "x"))  # fmt: skip
    return rows


def _spec_rows(stages: Sequence[StageLike]) -> list[dict[str, Any]]:
    """Issue 16: n-gram speculation over plain decoding (target >= 1.7x at one stream; at
    many streams it must not lose more than 5%)."""
    rows = []
    for s in stages:
        if not s.name.startswith("spec:"):
            continue
        label = s.name.split(":")[1]
        for streams in sorted({r["streams"] for r in s.records if r.get("kind") == "spec"}):
            plain = _find([s], "spec", method="plain", streams=streams)
            spec = _find([s], "spec", method="ngram", streams=streams)
            value = spec["output_tok_s"] / plain["output_tok_s"] if plain and spec else None
            want = SPEC_TARGET if streams == 1 else SPEC_FLOOR
            ok = None if value is None else value >= want
            ref = "-" if spec is None else (
                f"plain {plain['output_tok_s'] if plain else '-'} tok/s, "
                f"{spec['accepted_tokens']}/{spec['draft_tokens']} drafts accepted"
            )  # fmt: skip
            rows.append(_row(f"ngram / plain, {streams} stream(s), {label} (copying)", value,
                             f">= {want}", ref, ok, "x"))  # fmt: skip
            eager = _find([s], "spec", method="ngram+eager", streams=streams)
            if eager:  # issue 34: verify CUDA graphs over the eager verify step (no target)
                ratio = spec["output_tok_s"] / eager["output_tok_s"] if spec else None
                figure = f"spec verify graphs / eager, {streams} stream(s), {label}"
                ref = f"eager {eager['output_tok_s']} tok/s"
                rows.append(_row(figure, ratio, "-", ref, None, "x"))
    return rows


def _quant_rows(stages: Sequence[StageLike]) -> list[dict[str, Any]]:
    """Issue 13: FP8-weight TPOT speed-up over bf16, FP8 KV cache capacity over bf16's."""
    base, rows = "llama-3.1-8b", []
    bf16 = _find(stages, "tpot", model=base)
    fp8 = _find(stages, "tpot", model=f"{base}+fp8")
    if bf16 or fp8:
        speedup = bf16["tpot_ms"] / fp8["tpot_ms"] if bf16 and fp8 else None
        ok = None if speedup is None else speedup >= FP8_TPOT_SPEEDUP_TARGET
        ref = f"bf16 TPOT {bf16['tpot_ms']:.2f} ms" if bf16 else "-"
        target = f">= {FP8_TPOT_SPEEDUP_TARGET}x"
        rows.append(_row("TPOT b1 8B bf16 / FP8 weights", speedup, target, ref, ok, "x"))
    kv16 = _find(stages, "startup", model=base)
    kv8 = _find(stages, "startup", model=f"{base}+kvfp8")
    if kv16 or kv8:
        ratio = kv8["kv_blocks"] / kv16["kv_blocks"] if kv16 and kv8 else None
        ref = f"bf16 KV {kv16['kv_blocks']:,} blocks" if kv16 else "-"
        rows.append(_row("KV blocks 8B FP8 / bf16 cache", ratio, "~2x", ref, None, "x"))
    return rows


def _vlm_rows(stages: Sequence[StageLike]) -> list[dict[str, Any]]:
    """Issue 33: image+text requests/s (no target: a figure) and TTFT of a repeated image
    (encoder-output cache hit) over a new one, which must be below 1."""
    rows: list[dict[str, Any]] = []
    for s in stages:
        if not s.name.startswith("vlm:"):
            continue
        label = s.name.split(":")[1]
        run = _find([s], "vlm_throughput")
        ref = "-" if run is None else (
            f"{run['output_tok_s']:,.0f} out tok/s, {run['requests']} x {run['image_tokens']} "
            f"image tokens, encoder {run['encoder_share']:.0%} of the run"
        )  # fmt: skip
        rows.append(_row(f"VLM {label} image+text requests/s",
                         None if run is None else run["requests_s"], "-", ref, None))  # fmt: skip
        if run is not None:
            rows[-1]["verdict"] = "figure"
        ttft = _find([s], "vlm_ttft")
        ratio = None if ttft is None else ttft["ratio"]
        ref = "-" if ttft is None else (
            f"repeated {ttft['repeat_ms']:,.1f} ms vs new {ttft['new_ms']:,.1f} ms, "
            f"{ttft['encoder_cache_hits']} cache hits"
        )  # fmt: skip
        ok = None if ratio is None else ratio < 1.0
        rows.append(_row(f"VLM {label} TTFT repeated / new image", ratio, "< 1.00", ref, ok))
    return rows


def _kvtier_rows(stages: Sequence[StageLike]) -> list[dict[str, Any]]:
    """Issue 29: the host KV tier on vs off: prefill tokens (>= 3x fewer), TTFT p50 (<= 0.5x)
    on the multi-turn workload, output throughput with no reuse (>= 0.97)."""
    rows: list[dict[str, Any]] = []
    for s in stages:
        if not s.name.startswith("kvtier:"):
            continue
        label = s.name.split(":")[1]
        turns = _find([s], "kv_tier_multi_turn")
        ref = "-" if turns is None else (
            f"{turns['prefill_tokens_off']:,} / {turns['prefill_tokens_on']:,} tokens, "
            f"{turns['blocks_saved']} blocks saved, {turns['blocks_loaded']} loaded"
        )  # fmt: skip
        value = None if turns is None else turns["prefill_ratio"]
        ok = None if value is None else value >= 3.0
        figure = f"KV tier {label} prefill tokens off / on"
        rows.append(_row(figure, value, ">= 3.00", ref, ok, "x"))
        value = None if turns is None else turns["ttft_p50_ratio"]
        ref = "-" if turns is None else (
            f"p50 {turns['ttft_p50_ms_on']:,.1f} vs {turns['ttft_p50_ms_off']:,.1f} ms, "
            f"p99 {turns['ttft_p99_ms_on']:,.1f} vs {turns['ttft_p99_ms_off']:,.1f} ms"
        )  # fmt: skip
        ok = None if value is None else value <= 0.5
        rows.append(_row(f"KV tier {label} TTFT p50 on / off", value, "<= 0.50", ref, ok))
        plain = _find([s], "kv_tier_no_reuse")
        value = None if plain is None else plain["throughput_ratio"]
        ref = "-" if plain is None else (
            f"{plain['output_tok_s_on']:,.0f} vs {plain['output_tok_s_off']:,.0f} out tok/s"
        )  # fmt: skip
        ok = None if value is None else value >= 0.97
        figure = f"KV tier {label} no-reuse throughput on / off"
        rows.append(_row(figure, value, ">= 0.97", ref, ok))
    return rows


def _model_key(stage: StageLike, name: str) -> str:
    """Records carry the --model argument (a path for the smoke config)."""
    for r in stage.records:
        if "model" in r:
            return str(r["model"])
    return name


def _serve_row(stages: Sequence[StageLike]) -> dict[str, Any]:
    serve = _find(stages, "serve")
    if serve is None or "skipped" in serve:
        row = _row("served / offline (mixed, c=256)", None, ">= 0.90", "-", None)
        if serve is not None:
            row["verdict"] = f"skipped: {serve['skipped'][:120]}"
        return row
    offline = _find(stages, "throughput", model=serve["model"], workload="mixed")
    ratio = serve["output_tok_s"] / offline["output_tok_s"] if offline else None
    ref = f"served {serve['output_tok_s']:,.0f} tok/s, {serve['failed']} failed"
    ok = None if ratio is None else ratio >= SERVE_RATIO_TARGET and serve["failed"] == 0
    return _row("served / offline (mixed, c=256)", ratio, ">= 0.90", ref, ok)


def render_summary(stages: Sequence[StageLike], rows: list[dict[str, Any]]) -> str:
    lines = ["", "stage                          status                       seconds"]
    for s in stages:
        lines.append(f"{s.name:30s} {s.status:28s} {s.seconds:7.1f}")
    lines += ["", f"{'figure':50s} {'value':>12s} {'target':>10s}  {'verdict':8s} reference"]
    for r in rows:
        lines.append(
            f"{r['figure'][:50]:50s} {r['shown']:>12s} {r['target']:>10s}  "
            f"{r['verdict']:8s} {r['reference']}"
        )
    return "\n".join(lines)
