"""CUDA executor pieces that do not need a GPU: bucket choice, static-buffer padding, pinned
staging (unpinned on CPU), KV sizing arithmetic over fake memory reports, the profiling batch,
and the graph/eager executor paths run through Triton's CPU interpreter against the CPU
reference forward. The GPU itself is exercised by ``scripts/gpu_check.py``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tokenwire.kernels.cuda_graph_buckets import PAD_SEQ_LEN, PAD_SLOT, decode_batch_buckets
from tokenwire.kernels.kv_layout import NULL_BLOCK_ID
from tokenwire.kernels.paged_attention import build_cpu_plan
from tokenwire.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.worker.cuda_graphs import DecodeGraphs, decode_bucket, write_padded_decode
from tokenwire.runtime.worker.host_staging import HostStaging
from tokenwire.runtime.worker.input_batch import InputBatch, StepArrays
from tokenwire.runtime.worker.kv_cache import KVCache
from tokenwire.runtime.worker.kv_cache_sizing import (
    MemoryReport,
    _profile_inputs,
    gpu_num_blocks,
    min_blocks_for,
    profile_seq_lens,
)
from tokenwire.runtime.worker.runner_settings import RunnerSettings

GIB = 1 << 30
ON_CUDA = torch.cuda.is_available()
TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "eos_token_id": 2,
}  # fmt: skip


def _decode_arrays(n: int) -> StepArrays:
    return StepArrays(
        input_ids=np.arange(10, 10 + n, dtype=np.int64),
        positions=np.arange(20, 20 + n, dtype=np.int64),
        slot_mapping=np.arange(40, 40 + n, dtype=np.int64),
        query_start_loc=np.arange(n + 1, dtype=np.int32),
        seq_lens=np.arange(21, 21 + n, dtype=np.int32),
        block_tables=np.full((n, 2), 3, dtype=np.int32),
        num_decodes=n,
        max_query_len=1,
        max_seq_len=20 + n,
    )


def test_decode_bucket_only_for_pure_decode_that_fits() -> None:
    buckets = decode_batch_buckets(16)
    assert decode_bucket(_decode_arrays(3), buckets) == 4
    assert decode_bucket(_decode_arrays(16), buckets) == 16
    assert decode_bucket(_decode_arrays(17), buckets) is None  # larger than every bucket
    mixed = dataclasses.replace(_decode_arrays(3), num_decodes=2)
    assert decode_bucket(mixed, buckets) is None
    chunk = dataclasses.replace(_decode_arrays(3), input_ids=np.zeros(5, dtype=np.int64))
    assert decode_bucket(chunk, buckets) is None


def test_write_padded_decode_pads_rows_past_the_batch() -> None:
    """The padding rule: rows ``[n, bucket)`` become token 0 at position 0, slot -1 (no KV
    write) and seq_len 0 (no KV read); rows past the bucket are left alone."""
    host = {name: np.full(8, 99, dtype=np.int64) for name in ("input_ids", "positions")}
    host |= {"slot_mapping": np.full(8, 99, dtype=np.int64)}
    host |= {"seq_lens": np.full(8, 99, dtype=np.int32)}
    write_padded_decode(host, _decode_arrays(3), 4)
    assert host["input_ids"].tolist() == [10, 11, 12, 0, 99, 99, 99, 99]
    assert host["positions"].tolist() == [20, 21, 22, 0, 99, 99, 99, 99]
    assert host["slot_mapping"].tolist() == [40, 41, 42, -1, 99, 99, 99, 99]
    assert host["seq_lens"].tolist() == [21, 22, 23, 0, 99, 99, 99, 99]
    assert (PAD_SLOT, PAD_SEQ_LEN) == (-1, 0)
    write_padded_decode(host, _decode_arrays(1), 8)  # a smaller batch re-pads stale rows
    assert host["slot_mapping"].tolist() == [40, *[-1] * 7]
    assert host["seq_lens"].tolist() == [21, *[0] * 7]
    with pytest.raises(ValueError, match="does not fit"):
        write_padded_decode(host, _decode_arrays(5), 4)


def test_input_batch_pads_block_tables_with_the_null_block() -> None:
    """A reused row keeps none of its previous owner's block ids."""
    batch = InputBatch(max_num_seqs=1, max_model_len=64, block_size=16)
    row = batch.add_row(list(range(40)), [5, 6, 7], 0)
    assert batch.block_table[row].tolist() == [5, 6, 7, NULL_BLOCK_ID]
    batch.release_row(row)
    row = batch.add_row([1, 2], [9], 0)
    assert batch.block_table[row].tolist() == [9, NULL_BLOCK_ID, NULL_BLOCK_ID, NULL_BLOCK_ID]


def test_host_staging_round_trip_on_cpu() -> None:
    staging = HostStaging(
        max_num_batched_tokens=8, max_num_seqs=4, max_blocks_per_seq=3, device=torch.device("cpu")
    )
    a = _decode_arrays(3)
    inputs = staging.upload(a)
    assert inputs.input_ids.tolist() == a.input_ids.tolist()
    assert inputs.seq_lens.dtype == torch.int32 and inputs.seq_lens.tolist() == [21, 22, 23]
    assert inputs.block_tables.shape == (3, 2) and inputs.block_tables.tolist() == [[3, 3]] * 3
    assert not staging.pinned["input_ids"].is_pinned()  # pinned only for CUDA devices


def _report(weights: float, peak: float, non_torch: float = 0.5) -> MemoryReport:
    return MemoryReport(
        total=100 * GIB, weights=int(weights * GIB), peak=int(peak * GIB),
        non_torch=int(non_torch * GIB),
    )  # fmt: skip


def test_gpu_num_blocks_arithmetic() -> None:
    per_block = GIB // 1024  # 1 MiB blocks
    # 90 GiB limit - 20 GiB peak - 0.5 GiB outside torch = 69.5 GiB of blocks.
    assert gpu_num_blocks(_report(16, 20), 0.9, per_block, 2, cuda_graphs=False) == 71168
    # Graphs reserve one more activation peak (4 GiB).
    assert gpu_num_blocks(_report(16, 20), 0.9, per_block, 2, cuda_graphs=True) == 67072


def test_gpu_num_blocks_errors_name_the_flag() -> None:
    with pytest.raises(ValueError, match=r"weights .* do not fit.*--gpu-memory-utilization"):
        gpu_num_blocks(_report(60, 70), 0.5, 1 << 20, 2, cuda_graphs=False)
    with pytest.raises(ValueError, match=r"one max-length sequence.*--gpu-memory-utilization"):
        gpu_num_blocks(_report(16, 20), 0.25, 1 << 20, min_blocks=8000, cuda_graphs=False)
    assert min_blocks_for(4096, 16) == 257
    assert min_blocks_for(4097, 16) == 258


def test_profile_batch_splits_at_max_model_len_and_runs(tmp_path: Path) -> None:
    assert profile_seq_lens(2048, 4096) == [2048]
    assert profile_seq_lens(10000, 4096) == [4096, 4096, 1808]
    loaded = _tiny(tmp_path)
    ids, positions, caches, meta = _profile_inputs(loaded.model, 300, 128, 16)
    assert meta.num_seqs == 3 and positions.tolist()[128:131] == [0, 1, 2]
    plan = build_cpu_plan(meta.query_start_loc_np, meta.seq_lens_np, meta.block_tables, 0, 16)
    hidden = loaded.model(ids, positions, caches, dataclasses.replace(meta, cpu_plan=plan))
    assert hidden.shape == (300, 64)
    assert not any(c.any() for kv in caches for c in kv[:2])  # slot -1: nothing stored


def test_enforce_eager_config_and_flag() -> None:
    assert EngineConfig().enforce_eager is False
    import argparse

    from tokenwire.runtime.engine_args import EngineArgs
    from tokenwire.server.serve import add_serve_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_serve_parser(sub)
    parser = sub.choices["serve"]

    def config(argv: list[str]) -> EngineConfig:
        return EngineArgs.from_cli_args(parser.parse_args(argv)).create_engine_config()

    assert config(["--enforce-eager"]).enforce_eager is True
    assert config([]).enforce_eager is False


# ------------------------------------------------------------------ executor paths on CPU
def _tiny(tmp_path: Path) -> LoadedModel:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    cfg = ModelConfig(model=str(tmp_path), load_format="dummy", seed=3)
    return load_model(cfg, torch.device("cpu"), torch.float32)


def _prefilled(loaded: LoadedModel) -> tuple[KVCache, InputBatch, np.ndarray]:
    """Three sequences prefilled through the CPU reference path, one token appended each."""
    kv = KVCache.allocate(
        loaded.arch, CacheConfig(num_gpu_blocks_override=32), torch.device("cpu"), torch.float32
    )
    batch = InputBatch(8, loaded.max_model_len, 16)
    prompts = [list(range(3, 23)), [7, 8, 9, 10, 11], list(range(30, 70))]
    blocks = [[1, 2], [3], [4, 5, 6]]
    rows = np.array([batch.add_row(p, b, 0) for p, b in zip(prompts, blocks, strict=True)])
    lens = np.array([len(p) for p in prompts])
    _reference_forward(loaded, kv, batch.build(rows, lens, 0))
    batch.num_computed[rows] += lens
    batch.append_tokens(rows, [40, 41, 42])
    return kv, batch, rows


@torch.inference_mode()
def _reference_forward(loaded: LoadedModel, kv: KVCache, a: StepArrays) -> torch.Tensor:
    tables = torch.from_numpy(a.block_tables)
    plan = build_cpu_plan(a.query_start_loc, a.seq_lens, tables, a.num_decodes, 16)
    from tokenwire.kernels.attention_metadata import AttentionMetadata

    meta = AttentionMetadata(
        num_tokens=len(a.input_ids), num_seqs=len(a.seq_lens), num_decodes=a.num_decodes,
        block_size=16, slot_mapping=torch.from_numpy(a.slot_mapping),
        query_start_loc=torch.from_numpy(a.query_start_loc),
        seq_lens=torch.from_numpy(a.seq_lens), block_tables=tables,
        max_query_len=a.max_query_len, max_seq_len=a.max_seq_len,
        query_start_loc_np=a.query_start_loc, seq_lens_np=a.seq_lens, cpu_plan=plan,
    )  # fmt: skip
    out: torch.Tensor = loaded.model(
        torch.from_numpy(a.input_ids), torch.from_numpy(a.positions), kv.layers, meta
    )
    return out


class _EagerGraph:
    """Stands in for a captured CUDA graph: replay re-runs the captured call eagerly."""

    def __init__(self, graphs: DecodeGraphs, bucket: int) -> None:
        self.graphs, self.bucket = graphs, bucket

    def replay(self) -> None:
        self.graphs._run(self.bucket, self.graphs._meta(self.bucket))


@pytest.mark.skipif(ON_CUDA, reason="CPU interpreter test; gpu_check covers CUDA")
def test_graph_replay_and_eager_paths_match_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Padded static-buffer replay (bucket 4 for 3 rows) and the staged eager path give the
    reference decode hidden states; Triton kernels run in the CPU interpreter."""
    loaded = _tiny(tmp_path)
    kv, batch, rows = _prefilled(loaded)
    arrays = batch.build(rows, np.ones(3, dtype=np.int64), 3)
    want = _reference_forward(loaded, kv, arrays)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with torch.inference_mode():
        _check_executor_paths(loaded, kv, batch, arrays, want)


def _check_executor_paths(
    loaded: LoadedModel, kv: KVCache, batch: InputBatch, arrays: StepArrays, want: torch.Tensor
) -> None:
    from tokenwire.runtime.worker.cuda_runner import CudaGraphRunner

    graphs = DecodeGraphs(loaded.model, kv.layers, (1, 2, 4, 8), 16, batch.max_blocks_per_seq, 256)
    graphs.graphs[4] = _EagerGraph(graphs, 4)  # type: ignore[assignment]
    staging = HostStaging(8, 8, batch.max_blocks_per_seq, torch.device("cpu"))
    got = graphs.replay(staging, arrays, 4)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    assert graphs.static.slot_mapping[3].item() == PAD_SLOT  # the padded row stores nothing
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    config = EngineConfig(scheduler=scheduler, enforce_eager=True)
    executor = CudaGraphRunner(loaded, kv, RunnerSettings.from_config(config))
    assert executor.graphs is None
    torch.testing.assert_close(executor.forward(arrays), want, atol=2e-4, rtol=2e-4)
