"""The model runner's layout: its helpers are functions of explicit inputs (no runner), and the
runner and its CUDA-graph path take one settings record derived from the frozen config, with
one name per concept from the flag to the decode graph buckets."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tokenwire.kernels.cuda_graph_buckets import decode_batch_buckets
from tokenwire.runtime.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
)
from tokenwire.runtime.sample.sampler import Sampler
from tokenwire.runtime.sample.sampling_metadata import RowSamplingState
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.worker.cuda_runner import CudaGraphRunner, cuda_kv_cache
from tokenwire.runtime.worker.host_staging import HostStaging
from tokenwire.runtime.worker.input_batch import InputBatch
from tokenwire.runtime.worker.kv_cache_sizing import profile_memory
from tokenwire.runtime.worker.model_runner import ModelRunner
from tokenwire.runtime.worker.request_state import CachedRequestState
from tokenwire.runtime.worker.runner_caches import build_caches
from tokenwire.runtime.worker.runner_settings import RunnerSettings
from tokenwire.runtime.worker.sample_rows import RowSampler, sample_rows
from tokenwire.runtime.worker.spec.verify_step import plan_verify, verify_rows, write_drafts

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
VOCAB = 16
GREEDY = SamplingParams(temperature=0.0)


def _config_fields() -> set[str]:
    configs = (SchedulerConfig, CacheConfig, ModelConfig, LoRAConfig, EngineConfig)
    names = {f.name for c in configs for f in dataclasses.fields(c)}  # type: ignore[arg-type]
    # ``device`` arrives resolved (a torch.device, one per rank), not as the flag's string.
    return (names - {"device"}) | {"cache_config", "lora_config", "cuda_graphs"}


def _params(fn: Callable[..., Any]) -> set[str]:
    return set(inspect.signature(fn).parameters) - {"self"}


def test_the_runner_and_its_cuda_path_take_settings_not_loose_config_values() -> None:
    """No config value travels as a loose argument from the worker to the graph runner."""
    route = {
        "ModelRunner": ModelRunner.__init__,
        "build_caches": build_caches,
        "cuda_kv_cache": cuda_kv_cache,
        "CudaGraphRunner": CudaGraphRunner.__init__,
    }
    loose = {name: sorted(_params(fn) & _config_fields()) for name, fn in route.items()}
    assert loose == {name: [] for name in route}
    assert all("settings" in _params(fn) for fn in route.values())


def test_max_num_seqs_keeps_its_name_to_the_buckets() -> None:
    """The flag's name on every hop that sizes something by it, and no alias anywhere in the
    worker or the bucket ladder."""
    hops = (InputBatch.__init__, HostStaging.__init__, profile_memory, decode_batch_buckets)
    assert all("max_num_seqs" in _params(fn) for fn in hops)
    assert "max_num_batched_tokens" in _params(HostStaging.__init__)
    assert {f.name for f in dataclasses.fields(RunnerSettings)} >= {
        "max_num_seqs",
        "max_num_batched_tokens",
    }
    aliases = {"max_rows", "max_seqs", "max_tokens", "max_batch", "num_seqs_max"}
    files = [*(REPO / "runtime" / "worker").rglob("*.py"), REPO / "kernels/cuda_graph_buckets.py"]
    found = [
        (str(path.relative_to(REPO)), arg.arg)
        for path in files
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef)
        for arg in node.args.args + node.args.kwonlyargs
        if arg.arg in aliases
    ]
    assert found == []


def test_runner_settings_are_derived_once_from_the_engine_config() -> None:
    config = EngineConfig(
        model=ModelConfig(seed=7),
        cache=CacheConfig(block_size=32),
        scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64),
        lora=LoRAConfig(enable_lora=True),
    )
    settings = RunnerSettings.from_config(config)
    assert (settings.cache, settings.lora, settings.seed) == (config.cache, config.lora, 7)
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (3, 64)
    assert not settings.enforce_eager  # LoRA steps replay decode graphs too
    plain = RunnerSettings.from_config(EngineConfig())
    assert not plain.enforce_eager
    assert RunnerSettings.from_config(EngineConfig(enforce_eager=True)).enforce_eager
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_num_seqs = 4  # type: ignore[misc]


def _state(batch: InputBatch, request_id: str, prompt: list[int], computed: int) -> Any:
    output: list[int] = []
    sampling = RowSamplingState(GREEDY, None, prompt, output)
    state = CachedRequestState(request_id, list(prompt), output, GREEDY, [1], sampling)
    state.row = batch.add_row(prompt, state.block_ids, computed)
    return state


def _logits(argmax: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmax), VOCAB)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


def test_the_verify_step_runs_on_explicit_inputs() -> None:
    """A batch, a RowSampler and logits are all the verify step needs: the plain row samples,
    the drafted row keeps its first draft, gets the target's token at the mismatch, and its
    computed count steps back over the rejected draft."""
    batch = InputBatch(max_num_seqs=2, max_model_len=32, block_size=16)
    plain = _state(batch, "plain", [7, 8], computed=1)
    drafted = _state(batch, "drafted", [1, 2, 3, 4], computed=3)
    states, drafts = [plain, drafted], {"drafted": [5, 6]}
    rows = np.array([plain.row, drafted.row], dtype=np.int64)
    query_lens = np.array([1, 3], dtype=np.int64)
    write_drafts(batch, states, drafts)
    arrays = batch.build(rows, query_lens, num_decodes=1)
    batch.num_computed[rows] += query_lens
    plan = plan_verify(batch, drafts, states, rows, arrays)
    assert plan.positions.tolist() == [0, 1, 2, 3]
    sampling = RowSampler(Sampler(), torch.Generator(), VOCAB, CPU)
    # Scores: the plain row's next token 9; the drafted row's targets 5 (= d1), 11 (!= d2).
    out = verify_rows(sampling, batch, plan, _logits([9, 5, 11, 0]), states, rows, drafts, None)
    assert (out.req_ids, out.token_ids, out.extra_token_ids) == (
        ["plain", "drafted"],
        [9, 5],
        {"drafted": [11]},
    )
    assert (plain.output_token_ids, drafted.output_token_ids) == ([9], [5, 11])
    assert batch.token_ids[drafted.row, :6].tolist() == [1, 2, 3, 4, 5, 11]
    assert batch.num_tokens[rows].tolist() == [3, 6]
    assert batch.num_computed[rows].tolist() == [2, 5]  # one rejected draft stepped back


def test_sample_rows_runs_on_explicit_inputs() -> None:
    batch = InputBatch(max_num_seqs=1, max_model_len=8, block_size=4)
    state = _state(batch, "r", [3, 4], computed=2)
    rows = np.array([state.row], dtype=np.int64)
    sampling = RowSampler(Sampler(), torch.Generator(), VOCAB, CPU)
    out = sample_rows(sampling, batch, _logits([12]), [state], rows)
    assert (out.req_ids, out.token_ids, out.logprobs) == (["r"], [12], {})
    assert batch.token_ids[state.row, :3].tolist() == [3, 4, 12]
    assert state.output_token_ids == [12]
