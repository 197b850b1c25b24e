"""``scripts/gpu_check.py --smoke``: the GPU check's plumbing on CPU with a tiny model.

Every stage must run and finish ``ok`` (kernel tests skip without CUDA; parity compares the
CPU engine with itself; benches and the served benchmark use a tiny dummy config), the
summary table must come last, and the JSON report must land in ``$OUT``. Quick tests of the
stage list and of the data-parallel stage's skip with fewer than two GPUs (the smoke run
cannot take that path: on the CPU it runs two cores) beside it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """A module of ``scripts/`` (not a package: its folder goes on ``sys.path``)."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    return importlib.import_module(name)


def test_full_plan_runs_embed_and_dp_after_the_figures_before_the_last_kernel_tests(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plan = _script(monkeypatch, "gpu_check_plan")
    names = [s.name for s in plan.plan(argparse.Namespace(smoke=False), tmp_path / "r.jsonl")]
    assert names[-3:] == ["embed:qwen3-0.6b", "dp:llama-3.2-1b", "kernels-all"]
    assert names.index("bench:gpt-oss-20b") == len(names) - 4
    smoke = [s.name for s in plan.plan(argparse.Namespace(smoke=True), tmp_path / "r.jsonl")]
    assert smoke[-2:] == ["embed:tiny-embed", "dp:tiny"]


def test_dp_stage_with_one_gpu_records_its_skip_and_the_summary_shows_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    dp, summary = _script(monkeypatch, "gpu_check_dp"), _script(monkeypatch, "gpu_check_summary")
    records: list[dict[str, Any]] = []
    args = argparse.Namespace(smoke=False, model="llama-3.2-1b", label=None)
    dp.stage_dp(args, lambda **r: records.append({"stage": "dp", **r}), device_count=lambda: 1)
    assert records == [
        {"stage": "dp", "kind": "dp", "model": "llama-3.2-1b", "skipped": "needs 2 GPUs, 1 visible"}
    ]
    assert dp.skip_reason(False, lambda: 2) == "" and dp.skip_reason(True, lambda: 0) == ""
    stage = _script(monkeypatch, "gpu_check_plan").Stage("dp:llama-3.2-1b", [], 1.0, "ok")
    stage.records = records
    (row,) = [r for r in summary.summary_rows([stage]) if r["figure"].startswith("DP")]
    assert row["verdict"] == "skipped: needs 2 GPUs, 1 visible" and row["value"] is None


def test_embed_rows_show_the_ratio_as_a_figure_and_judge_the_cosine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    summary, plan = (
        _script(monkeypatch, "gpu_check_summary"),
        _script(monkeypatch, "gpu_check_plan"),
    )
    stage = plan.Stage("embed:m", [], 1.0, "ok")
    run = dict(kind="embed_throughput", requests=4, input_tokens=8, tokenwire_emb_s=30.0,
               hf_emb_s=10.0, tokenwire_tok_s=240.0, hf_tok_s=80.0, ratio=3.0)  # fmt: skip
    stage.records = [run, dict(kind="embed_match", inputs=4, min_cosine=0.95, ok=False)]
    rows = {r["figure"]: r for r in summary.summary_rows([stage])}
    assert rows["embeddings m tokenwire / HF"]["value"] == 3.0
    assert rows["embeddings m tokenwire / HF"]["verdict"] == "figure"
    assert rows["embeddings m cosine vs HF"]["verdict"] == "MISS"


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_stage(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHONSAFEPATH="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == [
        "kernels", "attn_bw", "parity", "bench:tiny", "serve:tiny", "bench:tiny+kvfp8", "lora:tiny",
        "bench:tiny-moe", "bench:tiny-mla", "bench:tiny-gpt-oss", "spec:tiny", "bench:tiny+async",
        "vlm:tiny-vlm", "kvtier:tiny", "embed:tiny-embed", "dp:tiny",
    ]  # fmt: skip
    assert all(s["status"] == "ok" for s in stages.values())
    kinds = {r.get("kind") for r in stages["bench:tiny"]["records"]}
    assert {"startup", "throughput", "tpot", "hf_static"} <= kinds
    assert all(r["ok"] for r in stages["parity"]["records"])
    serve = stages["serve:tiny"]["records"]
    assert serve and serve[0].get("completed") == 2 and serve[0].get("failed") == 0
    figures = {row["figure"]: row for row in report["summary"]}
    assert figures["mixed tiny output tok/s"]["value"] > 0
    assert figures["fixed tiny vs HF static"]["value"] > 0
    assert figures["TPOT batch 1 tiny+kvfp8 (ms)"]["value"] > 0  # --kv-cache-dtype reaches it
    assert figures["LoRA x4 mixed / base, tiny"]["value"] > 0
    assert figures["mixed tiny-moe output tok/s"]["value"] > 0  # a Mixtral config runs
    assert figures["TPOT batch 1 tiny+async (ms)"]["value"] > 0  # --async-scheduling reaches it
    # Issue 32's families (shrunken bundled configs): MLA + DeepSeekMoE, gpt-oss; the TPOT row
    # names the active weights one batch-1 step reads (the floor's numerator).
    for family in ("mla", "gpt-oss"):
        assert figures[f"mixed tiny-{family} output tok/s"]["value"] > 0
        tpot_row = figures[f"TPOT batch 1 tiny-{family} (ms)"]
        assert tpot_row["value"] > 0 and "GB/step" in tpot_row["reference"]
    spec = stages["spec:tiny"]["records"]
    assert {(r["method"], r["streams"]) for r in spec} == {
        (m, n) for m in ("plain", "ngram", "ngram+eager") for n in (1, 2)
    }
    assert sum(r["accepted_tokens"] for r in spec) > 0  # the copying model's drafts land
    assert figures["ngram / plain, 1 stream(s), tiny (copying)"]["value"] > 0
    assert figures["spec verify graphs / eager, 2 stream(s), tiny"]["value"] > 0  # issue 34
    # Issue 33: the VLM stage's image+text batch encodes each request's image once, and the
    # repeated image's TTFT rounds are encoder-cache hits.
    vlm = {r["kind"]: r for r in stages["vlm:tiny-vlm"]["records"]}
    run, ttft = vlm["vlm_throughput"], vlm["vlm_ttft"]
    assert run["images_encoded"] == run["requests"] == 2 and run["output_tokens"] == 8
    assert run["image_tokens"] == 64 and 0 < run["encoder_share"] < 1  # 64 px / (4 x 2)
    assert ttft["encoder_cache_hits"] == ttft["rounds"] == 2
    assert ttft["new_ms"] > 0 and ttft["repeat_ms"] > 0
    assert figures["VLM tiny-vlm image+text requests/s"]["value"] > 0
    assert figures["VLM tiny-vlm TTFT repeated / new image"]["value"] > 0
    # Issue 29: with the device cache under the conversations' transcripts, the host tier
    # saves blocks and loads them back, so fewer prompt tokens are computed.
    tier = {r["kind"]: r for r in stages["kvtier:tiny"]["records"]}
    turns = tier["kv_tier_multi_turn"]
    assert turns["blocks_saved"] > 0 and turns["blocks_loaded"] > 0
    assert turns["prefill_tokens_on"] < turns["prefill_tokens_off"]
    assert tier["kv_tier_no_reuse"]["output_tok_s_on"] > 0
    assert figures["KV tier tiny prefill tokens off / on"]["value"] > 1
    assert figures["KV tier tiny no-reuse throughput on / off"]["value"] > 0
    # Issue 34: the embedding stage's vectors equal HF's forward (float32), both sides timed.
    embed = {r["kind"]: r for r in stages["embed:tiny-embed"]["records"]}
    assert embed["embed_match"]["ok"] and embed["embed_match"]["min_cosine"] > 0.99
    run = embed["embed_throughput"]
    assert (run["requests"], run["input_tokens"], run["dimensions"]) == (8, 32, 64)
    assert run["tokenwire_emb_s"] > 0 and run["hf_emb_s"] > 0
    assert figures["embeddings tiny-embed tokenwire / HF"]["verdict"] == "figure"
    assert figures["embeddings tiny-embed cosine vs HF"]["verdict"] == "pass"
    # Data parallel on the CPU: one core then two, both serve the workload, greedy equal.
    dp_runs = [r for r in stages["dp:tiny"]["records"] if r["kind"] == "dp_throughput"]
    assert [(r["data_parallel_size"], r["completed"], r["failed"]) for r in dp_runs] == [
        (1, 2, 0), (2, 2, 0)
    ]  # fmt: skip
    (dp,) = [r for r in stages["dp:tiny"]["records"] if r["kind"] == "dp"]
    assert dp["greedy_equal"] and dp["ratio"] > 0
    assert figures["DP tiny greedy dp=2 == dp=1"]["verdict"] == "pass"
    assert figures["DP 2 / 1 mixed tok/s, tiny"]["value"] > 0
    # The summary table is the last thing printed.
    tail = proc.stdout.strip().splitlines()
    assert tail[-1].startswith("served / offline")
    assert (tmp_path / "logs" / "bench_tiny.log").is_file()
