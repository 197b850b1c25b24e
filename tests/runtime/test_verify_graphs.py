"""Verify CUDA graphs without a GPU: bucket choice, the per-row padding (padding tokens first,
slot -1), and a padded "replay" of a speculative verify step (3 rows in bucket 4, k = 3, one
row with fewer drafts and one with none) through Triton's CPU interpreter, against the CPU
reference forward of the unpadded step. A captured graph is stood in for by ``_EagerGraph``
(its replay re-runs the captured call over the static buffers)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.cuda_graph_buckets import PAD_SLOT
from tokenwire.kernels.paged_attention import build_cpu_plan
from tokenwire.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.worker.host_staging import HostStaging
from tokenwire.runtime.worker.input_batch import InputBatch, StepArrays
from tokenwire.runtime.worker.kv_cache import KVCache
from tokenwire.runtime.worker.runner_settings import RunnerSettings
from tokenwire.runtime.worker.verify_graphs import (
    VerifyGraphs,
    build_verify_graphs,
    verify_bucket,
    verify_buckets,
    write_padded_verify,
)

ON_CUDA = torch.cuda.is_available()
K = 3  # drafts per row: q = 4 query tokens
Q = 1 + K
TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "eos_token_id": 2,
}  # fmt: skip


def _arrays(lens: list[int]) -> StepArrays:
    """A step with the given query lengths (decode rows first), distinct values per token."""
    n, t = len(lens), sum(lens)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return StepArrays(
        input_ids=np.arange(10, 10 + t, dtype=np.int64),
        positions=np.arange(100, 100 + t, dtype=np.int64),
        slot_mapping=np.arange(40, 40 + t, dtype=np.int64),
        query_start_loc=qsl,
        seq_lens=np.arange(50, 50 + n, dtype=np.int32),
        block_tables=np.full((n, 4), 3, dtype=np.int32),
        num_decodes=sum(1 for x in lens if x == 1),
        max_query_len=max(lens),
        max_seq_len=50 + n,
    )


def test_verify_bucket_only_for_short_rows_that_fit() -> None:
    buckets = verify_buckets(16, 64, Q)
    assert buckets == (1, 2, 4, 8, 16)  # 16 rows x 4 tokens = 64 fit one step
    assert verify_buckets(16, 40, Q) == (1, 2, 4, 8)  # 16 x 4 would exceed the step budget
    assert verify_bucket(_arrays([1, 4, 2]), buckets, Q) == 4
    assert verify_bucket(_arrays([4, 4, 4, 4, 4]), buckets, Q) == 8
    assert verify_bucket(_arrays([1, 1, 1]), buckets, Q) is None  # pure decode: decode graphs
    assert verify_bucket(_arrays([1, 4, 9]), buckets, Q) is None  # a prefill chunk: eager
    assert verify_bucket(_arrays([2] * 17), buckets, Q) is None  # more rows than any bucket
    assert verify_bucket(_arrays([1, 4]), (), Q) is None  # no bucket fits the token budget


def test_write_padded_verify_puts_padding_first_with_slot_minus_one() -> None:
    """Row lengths 1, 4, 2 in bucket 4 of q = 4: each row ends with its real tokens; padding
    tokens hold token 0, the row's first position and slot -1; the padding row seq_len 0."""
    host = {name: np.full(20, 99, dtype=np.int64) for name in ("input_ids", "positions")}
    host |= {"slot_mapping": np.full(20, 99, dtype=np.int64)}
    host |= {"seq_lens": np.full(6, 99, dtype=np.int32)}
    dest = write_padded_verify(host, _arrays([1, 4, 2]), 4, Q)
    assert dest.tolist() == [3, 4, 5, 6, 7, 10, 11]
    assert host["input_ids"].tolist()[:17] == [0, 0, 0, 10, 11, 12, 13, 14, 0, 0, 15, 16,
                                               0, 0, 0, 0, 99]  # fmt: skip
    assert host["slot_mapping"].tolist()[:16] == [-1, -1, -1, 40, 41, 42, 43, 44, -1, -1,
                                                  45, 46, -1, -1, -1, -1]  # fmt: skip
    assert host["positions"].tolist()[:16] == [100, 100, 100, 100, 101, 102, 103, 104,
                                               105, 105, 105, 106, 0, 0, 0, 0]  # fmt: skip
    assert host["seq_lens"].tolist() == [50, 51, 52, 0, 99, 99]
    with pytest.raises(ValueError, match="does not fit"):
        write_padded_verify(host, _arrays([2] * 5), 4, Q)
    with pytest.raises(ValueError, match="more than 4"):
        write_padded_verify(host, _arrays([5]), 4, Q)


def test_build_verify_graphs_only_with_speculation(tmp_path: Path) -> None:
    loaded = _tiny(tmp_path)
    kv = _cache(loaded)
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    settings = RunnerSettings.from_config(EngineConfig(scheduler=scheduler))
    assert build_verify_graphs(loaded, kv, settings, 0) is None
    graphs = build_verify_graphs(loaded, kv, settings, K)
    assert graphs is not None and (graphs.buckets, graphs.query_len) == ((1, 2, 4, 8), Q)
    assert graphs.static.hidden.shape == (8 * Q, 64)


# ------------------------------------------------------------------ padded replay on CPU
def _tiny(tmp_path: Path) -> LoadedModel:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    cfg = ModelConfig(model=str(tmp_path), load_format="dummy", seed=3)
    return load_model(cfg, torch.device("cpu"), torch.float32)


def _cache(loaded: LoadedModel) -> KVCache:
    config = CacheConfig(num_gpu_blocks_override=32)
    return KVCache.allocate(loaded.arch, config, torch.device("cpu"), torch.float32)


@torch.inference_mode()
def _reference_forward(loaded: LoadedModel, kv: KVCache, a: StepArrays) -> torch.Tensor:
    tables = torch.from_numpy(a.block_tables)
    plan = build_cpu_plan(a.query_start_loc, a.seq_lens, tables, a.num_decodes, 16)
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


def _verify_step(loaded: LoadedModel, kv: KVCache, full: bool) -> StepArrays:
    """Three prefilled sequences, then a verify step: the decode row first (no drafts), then
    one with k drafts and one with a single draft (``full``: every row has k drafts)."""
    batch = InputBatch(8, loaded.max_model_len, 16)
    prompts = [list(range(3, 23)), [7, 8, 9, 10, 11], list(range(30, 70))]
    blocks = [[1, 2], [3], [4, 5, 6]]
    rows = np.array([batch.add_row(p, b, 0) for p, b in zip(prompts, blocks, strict=True)])
    lens = np.array([len(p) for p in prompts])
    _reference_forward(loaded, kv, batch.build(rows, lens, 0))
    batch.num_computed[rows] += lens
    batch.append_tokens(rows, [40, 41, 42])
    for row, drafts in zip(rows, ([50, 51, 52], [53, 54, 55], [56, 57, 58]), strict=True):
        start = int(batch.num_tokens[row])  # drafts after the known tokens
        batch.token_ids[row, start : start + K] = drafts
    if full:
        return batch.build(rows, np.full(3, Q, dtype=np.int64), 0)
    order = rows[[1, 0, 2]]
    return batch.build(order, np.array([1, Q, 2], dtype=np.int64), 1)


class _EagerGraph:
    """Stands in for a captured CUDA graph: replay re-runs the captured call eagerly."""

    def __init__(self, graphs: VerifyGraphs, bucket: int) -> None:
        self.graphs, self.bucket = graphs, bucket

    def replay(self) -> None:
        self.graphs._run(self.bucket, self.graphs._meta(self.bucket))


def _slot_rows(kv: KVCache) -> list[torch.Tensor]:
    """Every layer's K and V viewed as [num_slots, ...] rows."""
    return [c.reshape(-1, *c.shape[2:]).clone() for layer in kv.layers for c in layer[:2]]


@pytest.mark.skipif(ON_CUDA, reason="CPU interpreter test; gpu_check covers CUDA")
@pytest.mark.parametrize("full", [False, True])
def test_padded_verify_replay_matches_reference_and_stores_no_padding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full: bool
) -> None:
    """Replay in bucket 4 (q = 4) gives the reference hidden states at every real token; the
    cache changes only at the step's real slots (padding tokens and rows store no KV)."""
    loaded = _tiny(tmp_path)
    kv_ref, kv = _cache(loaded), _cache(loaded)
    arrays = _verify_step(loaded, kv_ref, full)
    _verify_step(loaded, kv, full)
    before = _slot_rows(kv)
    want = _reference_forward(loaded, kv_ref, arrays)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    graphs = VerifyGraphs(loaded.model, kv.layers, (1, 2, 4, 8), Q, 16, 16, 256)
    graphs.graphs[4] = _EagerGraph(graphs, 4)  # type: ignore[assignment]
    graphs.static.slot_mapping.fill_(7)  # stale slots: the replay must overwrite every one
    staging = HostStaging(64, 8, 16, torch.device("cpu"))
    with torch.inference_mode():
        got = graphs.try_replay(staging, arrays)
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    real = torch.from_numpy(arrays.slot_mapping)
    assert int((graphs.static.slot_mapping[: 4 * Q] == PAD_SLOT).sum()) == 4 * Q - len(real)
    untouched = torch.ones(before[0].shape[0], dtype=torch.bool)
    untouched[real] = False
    for old, new, ref in zip(before, _slot_rows(kv), _slot_rows(kv_ref), strict=True):
        assert torch.equal(new[untouched], old[untouched])  # padding wrote nothing
        torch.testing.assert_close(new[real], ref[real], atol=2e-4, rtol=2e-4)


@pytest.mark.skipif(ON_CUDA, reason="CPU interpreter test; gpu_check covers CUDA")
def test_cuda_runner_routes_verify_steps_to_verify_graphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CudaGraphRunner.forward``: a verify step replays the verify graph, a prefill chunk
    longer than q does not (it runs eagerly)."""
    from tokenwire.runtime.worker.cuda_graphs import DecodeGraphs
    from tokenwire.runtime.worker.cuda_runner import CudaGraphRunner

    loaded = _tiny(tmp_path)
    kv = _cache(loaded)
    arrays = _verify_step(loaded, kv, full=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    settings = RunnerSettings.from_config(EngineConfig(scheduler=scheduler, enforce_eager=True))
    runner = CudaGraphRunner(loaded, kv, settings, K)
    assert runner.verify is None  # enforce_eager: no graphs at all
    runner.graphs = DecodeGraphs(loaded.model, kv.layers, (1, 2, 4, 8), 16, 16, 256)
    verify = build_verify_graphs(loaded, kv, settings, K)
    assert verify is not None
    replayed: list[int] = []

    class _Counting(_EagerGraph):
        def replay(self) -> None:
            replayed.append(self.bucket)
            super().replay()

    for bucket in verify.buckets:
        verify.graphs[bucket] = _Counting(verify, bucket)  # type: ignore[assignment]
    runner.verify = verify
    with torch.inference_mode():
        got = runner.forward(arrays)
        assert replayed == [4] and got.shape == (len(arrays.input_ids), 64)
        chunk = dataclasses.replace(arrays, query_start_loc=np.array([0, 1, 7], np.int32))
        chunk = dataclasses.replace(chunk, seq_lens=arrays.seq_lens[:2])
        runner.forward(dataclasses.replace(chunk, block_tables=arrays.block_tables[:2]))
    assert replayed == [4]  # the 6-token row ran eagerly
