"""``tokenwire bench llamacpp`` (issue 42, item 4): its flags, where it looks for llama-server,
what it says when there is none, and how it reduces runs to the table's ratios. The comparison
itself needs a built llama-server (``--build``, about 10-20 minutes here); its figures are in
docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenwire.bench.configs import LlamaCppBenchConfig
from tokenwire.bench.llamacpp_build import built_server
from tokenwire.bench.llamacpp_cli import llamacpp_config
from tokenwire.bench.llamacpp_compare import _summary, resolve_binary
from tokenwire.bench.workloads import SHORT_OUTPUT, SHORT_PROMPT, make_workload
from tokenwire.server.cli import build_parser


def _parse(*flags: str) -> LlamaCppBenchConfig:
    return llamacpp_config(build_parser().parse_args(["bench", "llamacpp", *flags]))


def test_flags_become_the_config() -> None:
    assert _parse() == LlamaCppBenchConfig()
    config = _parse("--concurrency", "1", "16", "--rounds", "2", "--serve-args", "--dtype", "auto")
    assert config.concurrency == (1, 16) and config.rounds == 2
    assert config.serve_args == ("--dtype", "auto")
    with pytest.raises(ValueError, match="--concurrency"):
        _parse("--concurrency", "0")


def test_short_workload_is_the_comparisons_shape() -> None:
    workload = make_workload("short", vocab_size=49152)
    assert len(workload.prompts) == 64
    assert {len(p) for p in workload.prompts} == {SHORT_PROMPT}
    assert set(workload.output_lens) == {SHORT_OUTPUT}


def test_no_llama_server_names_the_way_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENWIRE_CACHE_DIR", str(tmp_path))
    assert built_server().is_relative_to(tmp_path)
    with pytest.raises(SystemExit, match="--build") as err:
        resolve_binary(LlamaCppBenchConfig())
    assert str(built_server()) in str(err.value)
    given = tmp_path / "my-llama-server"
    assert resolve_binary(LlamaCppBenchConfig(llama_server=str(given))) == given
    built_server().parent.mkdir(parents=True)
    built_server().write_bytes(b"")  # a cached build is used without --build
    assert resolve_binary(LlamaCppBenchConfig()) == built_server()


def test_summary_takes_medians_per_side_and_the_ratio() -> None:
    def run(side: str, tok_s: float, ttft: float, failed: int = 0) -> dict[str, object]:
        return {"side": side, "concurrency": 16, "output_throughput": tok_s,
                "median_ttft_ms": ttft, "failed": failed}  # fmt: skip

    runs = [run("tokenwire", 300, 50), run("tokenwire", 360, 70, 1), run("tokenwire", 330, 60)]
    runs += [run("llama.cpp", 200, 40), run("llama.cpp", 220, 30)]
    (row,) = _summary(runs, (16,))
    assert row["tokenwire_tok_s"] == 330 and row["llama.cpp_tok_s"] == 210
    assert row["ratio"] == round(330 / 210, 3)
    assert row["tokenwire_ttft_p50_ms"] == 60 and row["llama.cpp_ttft_p50_ms"] == 35
    assert row["tokenwire_failed"] == 1 and row["llama.cpp_failed"] == 0


def test_a_request_reported_in_usage_only_counts_as_completed() -> None:
    """llama-server streams empty-text chunks while a token's bytes are not yet valid UTF-8:
    a request with no text chunk but a usage report of its tokens completed; one with neither
    (or an error) failed."""
    from tokenwire.bench.serve_metrics import RequestResult, summarize

    texted = RequestResult(0.0, 1.0, 8, [(0.2, 1), (0.6, 1)], reported_output_tokens=4)
    usage_only = RequestResult(0.0, 1.0, 8, [], reported_output_tokens=4)
    nothing = RequestResult(0.0, 1.0, 8, [])
    broken = RequestResult(0.0, 1.0, 8, [(0.2, 1)], error="HTTP 500")
    summary = summarize([texted, usage_only, nothing, broken], duration=2.0)
    assert (summary["completed"], summary["failed"]) == (2, 2)
    assert summary["total_output_tokens"] == 8 and summary["output_throughput"] == 4.0
    assert summary["median_ttft_ms"] == 200.0  # from the request that has arrival times
