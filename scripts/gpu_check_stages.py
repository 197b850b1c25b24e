"""Stages of ``gpu_check.py``, each run in its own process: ``gpu_check_stages.py STAGE ...``.

A stage appends one JSON record per finished measurement to ``--results`` (JSON lines), so a
stage killed at its time limit keeps everything it measured before. ``--smoke`` swaps the
CUDA device and the bundled benchmark shapes for the CPU and a tiny config, with tiny request
counts, so the plumbing runs anywhere. Stages: ``attn_bw``, ``parity``, ``bench``, ``serve``,
``lora``, ``spec``, ``vlm``, ``kvtier``, ``embed``, ``dp`` (the kernel tests are plain pytest,
launched by the orchestrator); ``bench``, ``lora`` and ``spec`` live in ``gpu_check_bench.py``,
``vlm``, ``kvtier``, ``embed`` and ``dp`` in their own files beside this one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenwire.runtime.config import DType

REPO = Path(__file__).resolve().parents[1]
# Tiny Llama for --smoke benches: the bundled shapes' stand-in (long context for `mixed`).
SMOKE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
BENCH_MAX_MODEL_LEN = 4096  # mixed needs <= 1024 + 1024; a short table keeps copies small
BENCH_BATCHED_TOKENS = 8192


class Recorder:
    def __init__(self, path: Path, stage: str) -> None:
        self.path, self.stage = path, stage

    def __call__(self, **record: Any) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"stage": self.stage, **record}) + "\n")


def device_name(smoke: bool) -> str:
    return "cpu" if smoke else "cuda"


# ---------------------------------------------------------------------- (b) parity
def _tiny_hf_model(out: Path) -> Path:
    spec = importlib.util.spec_from_file_location(
        "tw_tiny_models", REPO / "tests" / "support" / "tiny_models.py"
    )
    assert spec is not None and spec.loader is not None
    tiny_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_models)
    path: Path = tiny_models.build_tiny_model("llama", out)
    return path


def _greedy(model: Path, device: str, dtype: DType, eager: bool) -> list[list[int]]:
    from tokenwire.runtime.llm import LLM
    from tokenwire.runtime.sampling_params import SamplingParams

    llm = LLM(
        str(model), device=device, dtype=dtype, max_num_seqs=16, enforce_eager=eager,
        num_gpu_blocks_override=256, max_model_len=512,
    )  # fmt: skip
    # Lengths straddle block boundaries; staggered output lengths make the decode batch
    # shrink through several graph buckets (16 -> 8 -> 4 -> 2 -> 1) and pad rows.
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(12)]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4 + 3 * i) for i in range(12)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def stage_parity(args: argparse.Namespace, record: Recorder) -> None:
    dev = device_name(args.smoke)
    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_hf_model(Path(tmp))
        reference = _greedy(model, "cpu", "float32", eager=True)
        cases: list[tuple[DType, bool]] = [
            ("float32", True)
        ]  # --smoke: the plumbing, CPU against CPU
        if not args.smoke:
            cases += [("float32", False), ("bfloat16", True), ("bfloat16", False)]
        runs: dict[tuple[DType, bool], list[list[int]]] = {}
        for dtype, eager in cases:
            runs[(dtype, eager)] = _greedy(model, dev, dtype, eager)
            mode = "eager" if eager else "graphs"
            if dtype == "float32":
                same = runs[(dtype, eager)] == reference
                record(check=f"greedy {dev} float32 {mode} == cpu", ok=same)
        if not args.smoke:
            same = runs[("bfloat16", True)] == runs[("bfloat16", False)]
            record(check=f"greedy {dev} bfloat16 graphs == eager", ok=same)


# ---------------------------------------------------------------------- (a) kernel bandwidth
def stage_attn_bw(args: argparse.Namespace, record: Recorder) -> None:
    """Paged decode attention, batch 256 x context 1024, Llama-3.1-8B heads, bf16."""
    if args.smoke:
        record(kind="attn_bw", skipped="needs CUDA (smoke run)")
        return
    import numpy as np
    import torch
    import triton.testing

    from tokenwire.bench.roofline import lookup_device
    from tokenwire.kernels.attention_metadata import AttentionMetadata
    from tokenwire.kernels.paged_attention_triton import paged_attention_triton

    batch, ctx, hq, hkv, dim, bs = 256, 1024, 32, 8, 128, 16
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    blocks = batch * ctx // bs
    k_cache = torch.randn(blocks + 1, bs, hkv, dim, dtype=bf16, device=dev)
    v_cache = torch.randn_like(k_cache)
    tables = (1 + torch.randperm(blocks, device=dev)).to(torch.int32).view(batch, ctx // bs)
    meta = AttentionMetadata(
        num_tokens=batch, num_seqs=batch, num_decodes=batch, block_size=bs,
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=dev),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
        block_tables=tables, max_query_len=1, max_seq_len=ctx,
        query_start_loc_np=np.arange(batch + 1, dtype=np.int32),
        seq_lens_np=np.full(batch, ctx, dtype=np.int32),
    )  # fmt: skip
    query = torch.randn(batch, hq, dim, dtype=bf16, device=dev)
    ms = triton.testing.do_bench(
        lambda: paged_attention_triton(query, k_cache, v_cache, meta, dim**-0.5)
    )
    moved = 2 * batch * ctx * hkv * dim * 2  # K and V bytes read; queries/outputs are tiny
    # Against the roofline table's bandwidth for this device (H200: the measured 4.25 TB/s).
    ceilings = lookup_device(torch.cuda.get_device_name())
    peak = None if ceilings is None else ceilings.bandwidth / 1e12
    tb_s = moved / ms / 1e9
    record(kind="attn_bw", ms=round(ms, 4), tb_s=round(tb_s, 3),
           peak_tb_s=peak, fraction=None if peak is None else round(tb_s / peak, 3))  # fmt: skip


# ---------------------------------------------------------------------- (d) served bench
def _serve_command(model: str, port: int, smoke: bool) -> list[str]:
    return [
        sys.executable, "-c",
        "import sys; from tokenwire.server.cli import main; sys.exit(main(sys.argv[1:]))",
        "serve", model, "--load-format", "dummy", "--device", device_name(smoke),
        "--dtype", "float32" if smoke else "bfloat16", "--disable-rest",
        "--host", "127.0.0.1", "--grpc-port", str(port), "--log-format", "json",
        "--max-model-len", str(BENCH_MAX_MODEL_LEN),
        "--max-num-batched-tokens", str(BENCH_BATCHED_TOKENS),
    ]  # fmt: skip


def _wait_serving(proc: subprocess.Popen[str], timeout: float) -> str:
    """Block until the server logs that it is serving; '' on success, else why not."""
    ready = threading.Event()
    tail: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail[:] = [*tail[-20:], line.rstrip()]
            if "serving model=" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            return "server did not become ready: " + " | ".join(tail[-5:])
    return ""


def _serve_bench(port: int, vocab: int, smoke: bool) -> dict[str, Any]:
    from tokenwire.bench.configs import ServeBenchConfig
    from tokenwire.bench.serve import serve_bench_summary

    # --smoke: the `cpu` workload's short outputs (mixed's run to 1024 tokens).
    workload, n, conc = ("cpu", 2, 2) if smoke else ("mixed", 256, 256)
    config = ServeBenchConfig(
        target=f"127.0.0.1:{port}", workload=workload, num_requests=n, concurrency=conc,
        vocab_size=vocab,
    )  # fmt: skip
    return serve_bench_summary(config)


def stage_serve(args: argparse.Namespace, record: Recorder) -> None:
    try:  # the server stack needs grpcio, structlog, opentelemetry, ...: skip without them
        import tokenwire.bench.serve
        import tokenwire.server.serve  # noqa: F401
    except ImportError as exc:
        record(kind="serve", skipped=f"{type(exc).__name__}: {exc}")
        return
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        _serve_command(args.model, port, args.smoke), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=os.environ.copy(),
    )  # fmt: skip
    try:
        why = _wait_serving(proc, args.ready_timeout)
        if why:
            record(kind="serve", skipped=why[-2000:])
            return
        s = _serve_bench(port, args.vocab, args.smoke)
        record(kind="serve", model=args.model, output_tok_s=s["output_throughput"],
               concurrency=s["concurrency"], completed=s["completed"], failed=s["failed"],
               median_ttft_ms=s["median_ttft_ms"], median_tpot_ms=s["median_tpot_ms"])  # fmt: skip
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _offline_stage(name: str) -> Callable[[argparse.Namespace, Recorder], None]:
    """A stage of ``gpu_check_bench.py`` (the offline benches, beside this file; PYTHONSAFEPATH
    keeps it off sys.path)."""

    def run(args: argparse.Namespace, record: Recorder) -> None:
        sys.path.insert(0, str(REPO / "scripts"))
        import gpu_check_bench

        getattr(gpu_check_bench, name)(args, record)

    return run


def _stage_vlm(args: argparse.Namespace, record: Recorder) -> None:
    """Issue 33: a 3B-class VLM's image+text throughput and repeated-image TTFT
    (``gpu_check_vlm.py``, beside this file; PYTHONSAFEPATH keeps it off sys.path)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_check_vlm import stage_vlm

    with tempfile.TemporaryDirectory(prefix="gpu-check-vlm-") as tmp:
        stage_vlm(args, record, Path(tmp))


def _stage_kvtier(args: argparse.Namespace, record: Recorder) -> None:
    """Issue 29: the host KV tier's multi-turn and no-reuse figures (``gpu_check_kvtier.py``)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_check_kvtier import stage_kvtier

    stage_kvtier(args, record)


def _stage_embed(args: argparse.Namespace, record: Recorder) -> None:
    """Issue 34: a decoder embedding model against HF's forward (``gpu_check_embed.py``)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_check_embed import stage_embed

    with tempfile.TemporaryDirectory(prefix="gpu-check-embed-") as tmp:
        stage_embed(args, record, Path(tmp))


def _stage_dp(args: argparse.Namespace, record: Recorder) -> None:
    """Issue 34: ``--data-parallel-size 2`` vs 1, served (``gpu_check_dp.py``)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_check_dp import stage_dp

    stage_dp(args, record)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    kinds = ["attn_bw", "parity", "bench", "serve", "lora", "spec", "vlm", "kvtier", "embed", "dp"]
    p.add_argument("stage", choices=kinds)
    p.add_argument("--results", type=Path, required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--model", default="llama-3.2-1b", help="bundled name or config dir")
    p.add_argument("--hf", action="store_true", help="bench: fixed workload + HF static")
    p.add_argument("--hf-requests", type=int, default=None, help="HF: first N requests only")
    p.add_argument("--vocab", type=int, default=128256, help="serve: workload vocabulary")
    p.add_argument("--ready-timeout", type=float, default=120.0)
    p.add_argument("--quantization", default=None, help="bench: weight scheme (dummy weights)")
    p.add_argument("--kv-cache-dtype", default="auto", help="bench: KV cache storage")
    p.add_argument("--label", default=None, help="bench: name recorded (default: --model)")
    p.add_argument("--tpot-only", action="store_true", help="bench: skip the mixed workload")
    p.add_argument("--async-scheduling", action="store_true", help="bench: async steps (43)")
    p.add_argument("--image-side", type=int, default=448, help="vlm: image pixels, square")
    p.add_argument("--vlm-requests", type=int, default=64, help="vlm: image+text requests")
    p.add_argument("--vlm-rounds", type=int, default=8, help="vlm: TTFT rounds (new, repeat)")
    p.add_argument("--embed-requests", type=int, default=1024, help="embed: inputs at once")
    p.add_argument("--embed-tokens", type=int, default=256, help="embed: tokens per input")
    p.add_argument("--embed-batch", type=int, default=64, help="embed: HF batch size")
    args = p.parse_args(argv)
    stages = {
        "attn_bw": stage_attn_bw,
        "parity": stage_parity,
        "bench": _offline_stage("stage_bench"),
        "serve": stage_serve,
        "lora": _offline_stage("stage_lora"),
        "spec": _offline_stage("stage_spec"),
        "vlm": _stage_vlm,
        "kvtier": _stage_kvtier,
        "embed": _stage_embed,
        "dp": _stage_dp,
    }
    stages[args.stage](args, Recorder(args.results, args.stage))
    return 0


if __name__ == "__main__":
    sys.exit(main())
