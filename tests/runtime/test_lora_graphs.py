"""Decode CUDA graphs with LoRA, on CPU: a padded static-buffer "replay" (``_EagerGraph``
re-runs the captured body eagerly over the static inputs and the ``LoRAManager``'s persistent
segment buffers, as a replay reads them) against the eager LoRA forward, Triton kernels in
the CPU interpreter. The GPU itself is exercised by ``scripts/gpu_check_bench.py``'s
``stage_lora`` (graphs against ``enforce_eager`` in one run)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cuda_runner import TINY, _EagerGraph, _reference_forward

from tokenwire.kernels.cuda_graph_buckets import PAD_SLOT
from tokenwire.runtime.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
)
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.lora.manager import LoRAManager
from tokenwire.runtime.worker.cuda_graphs import DecodeGraphs
from tokenwire.runtime.worker.host_staging import HostStaging
from tokenwire.runtime.worker.input_batch import InputBatch, StepArrays
from tokenwire.runtime.worker.kv_cache import KVCache
from tokenwire.runtime.worker.runner_settings import RunnerSettings

ON_CUDA = torch.cuda.is_available()
RANK = 4
TOL = {"atol": 2e-4, "rtol": 2e-4}


def _tiny(tmp_path: Path) -> LoadedModel:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    cfg = ModelConfig(model=str(tmp_path), load_format="dummy", seed=5)
    return load_model(cfg, torch.device("cpu"), torch.float32)


def _random_slot(manager: LoRAManager, slot: int, seed: int) -> None:
    """Load a random rank-``RANK`` adapter on every projection into ``slot``."""
    arch = manager.arch
    head_dim = arch.hidden_size // arch.num_attention_heads
    kv = arch.num_key_value_heads * head_dim
    h, inter = arch.hidden_size, arch.intermediate_size
    shapes = {  # module: (in, out)
        "q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for layers in manager.layers:
        weights = {
            module: (
                torch.randn(RANK, fan_in, generator=gen) * 0.3,
                torch.randn(fan_out, RANK, generator=gen) * 0.3,
            )
            for module, (fan_in, fan_out) in shapes.items()
        }
        for layer in layers:
            layer.set_slot(slot, weights)


def _setup(loaded: LoadedModel) -> tuple[KVCache, InputBatch, np.ndarray, LoRAManager]:
    """Three sequences prefilled by the base model, one token appended each; LoRA wraps the
    model afterwards with two random adapters in slots 0 and 1."""
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
    config = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8)
    manager = LoRAManager(loaded.model, config, torch.float32, torch.device("cpu"))
    _random_slot(manager, 0, seed=1)
    _random_slot(manager, 1, seed=2)
    return kv, batch, rows, manager


def _kv_snapshot(kv: KVCache) -> list[torch.Tensor]:
    return [t.clone() for layer in kv.layers for t in layer[:2]]


def _assert_kv_only_at(kv: KVCache, before: list[torch.Tensor], arrays: StepArrays) -> None:
    """Only the step's own slots changed: the padded row stored nothing."""
    after = _kv_snapshot(kv)
    step_slots = torch.from_numpy(arrays.slot_mapping)
    for old, new in zip(before, after, strict=True):
        flat_old, flat_new = old.flatten(0, 1), new.flatten(0, 1)  # [blocks * block_size, ...]
        keep = torch.ones(flat_old.shape[0], dtype=torch.bool)
        keep[step_slots] = False
        assert torch.equal(flat_old[keep], flat_new[keep])


@pytest.mark.skipif(ON_CUDA, reason="CPU interpreter test; gpu_check_bench covers CUDA")
def test_lora_graph_replay_matches_eager_and_clears_stale_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of adapter A, the base and adapter B replayed in bucket 4 (one padded row) give
    the eager LoRA hidden states; a following base-only replay gives the base model's (the
    previous step's runs were cleared); neither stores KV for the padded row."""
    loaded = _tiny(tmp_path)
    kv, batch, rows, manager = _setup(loaded)
    arrays = batch.build(rows, np.ones(3, dtype=np.int64), 3)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    graphs = DecodeGraphs(
        loaded.model, kv.layers, (1, 2, 4, 8), 16, batch.max_blocks_per_seq, 256, manager
    )
    graphs.graphs[4] = _EagerGraph(graphs, 4)  # type: ignore[assignment]
    staging = HostStaging(8, 8, batch.max_blocks_per_seq, torch.device("cpu"))
    with torch.inference_mode():
        manager.set_tokens(np.array([0, -1, 1]))  # A, base, B
        want_lora = _reference_forward(loaded, kv, arrays)  # the eager LoRA forward
        before = _kv_snapshot(kv)
        got_lora = graphs.replay(staging, arrays, 4).clone()
        _assert_kv_only_at(kv, before, arrays)
        assert graphs.static.slot_mapping[3].item() == PAD_SLOT
        manager.set_tokens(None)  # the next step uses no adapter
        assert graphs.bucket_for(arrays) == 4
        want_base = _reference_forward(loaded, kv, arrays)
        before = _kv_snapshot(kv)
        got_base = graphs.replay(staging, arrays, 4)
        _assert_kv_only_at(kv, before, arrays)
    torch.testing.assert_close(got_lora, want_lora, **TOL)
    torch.testing.assert_close(got_base, want_base, **TOL)
    torch.testing.assert_close(got_lora[1], want_base[1], **TOL)  # the base row
    for row in (0, 2):  # the adapters really change their rows
        assert not torch.allclose(want_lora[row], want_base[row], **TOL)


@pytest.mark.skipif(ON_CUDA, reason="CPU interpreter test; gpu_check_bench covers CUDA")
def test_capture_starts_from_no_runs_and_restores_the_context(tmp_path: Path) -> None:
    """A step is graphable when its runs are in the buffers for its rows (not on the masked
    CPU path); ``clear_runs`` (before capture) leaves every segment unused; ``graph_rows``
    puts the layers on the segmented path for the bucket's rows and gives the step its own
    context back."""
    loaded = _tiny(tmp_path)
    _, _, _, manager = _setup(loaded)
    manager.set_tokens(np.array([0, 0, -1]))  # one run: the segmented path, as on CUDA
    assert manager.graphable(3) and not manager.graphable(4)
    manager.set_tokens(np.array([0, 0, 1]))  # two runs: the masked CPU path
    assert not manager.graphable(3)
    manager.clear_runs()
    with manager.graph_rows(4):
        segments = manager.context.segments
        assert segments is not None and segments.num_tokens == 4 and segments.runs == ()
        assert manager.context.token_slots is None
        assert segments.lengths.tolist() == [0] * 4
    assert manager.context.token_slots is not None  # the masked CPU step's context is back


def test_lora_no_longer_forces_enforce_eager() -> None:
    lora = LoRAConfig(enable_lora=True)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    assert not RunnerSettings.from_config(EngineConfig(lora=lora, scheduler=sched)).enforce_eager
    eager = EngineConfig(lora=lora, scheduler=sched, enforce_eager=True)
    assert RunnerSettings.from_config(eager).enforce_eager
