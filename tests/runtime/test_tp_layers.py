"""Tensor-parallel layers and sharded loading: TP=2 (two gloo processes) equals TP=1.

Every supported family runs a scripted prefill / chunked-prefill / decode sequence through
``ModelRunner.execute_model`` at TP=1 (in this process) and at TP=2 (two spawned processes on a
gloo group): greedy tokens, seeded-sampled tokens and (prompt) logprobs agree (1e-4), direct
forward logits agree (1e-4), and the two ranks' outputs and logits are bitwise identical.
Covered: KV-head replication (1 KV head on 2 ranks; 3 KV heads on 6 ranks), a vocabulary not
divisible by the TP size (511), tied and untied embeddings, qkv bias, q/k norm, dummy weights.
Impossible splits raise errors naming ``--tensor-parallel-size``; a rank reads only its slices
of the safetensors file. Splits that need more ranks than the gloo pair (TP=3, TP=6) run on a
thread-backed group whose collectives exchange tensors in memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import build_tiny_model
from tp_ranks import (
    CPU,
    GlooRanks,
    assert_ranks_identical,
    assert_same_run,
    run_rank,
    run_threads,
)

from tokenwire.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.loader.model_loader import load_model
from tokenwire.runtime.models.arch import ModelArch, split_heads
from tokenwire.runtime.models.llama import build_model
from tokenwire.runtime.worker.model_runner import ModelRunner
from tokenwire.runtime.worker.runner_settings import RunnerSettings

FLAG = "--tensor-parallel-size"

# name -> (family, config overrides). TP=2 splits: llama 4 heads / 2 KV heads; mistral's one
# KV head is replicated; qwen2 (6 heads, qkv bias, tied) with a 511-token vocabulary; qwen3
# (q/k norm, tied); an untied llama with one KV head and an odd vocabulary.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral-kv1": ("mistral", {}),
    "qwen2-tied-vocab511": ("qwen2", {"vocab_size": 511}),
    "qwen3-qknorm": ("qwen3", {}),
    "llama-kv1-vocab511": ("llama", {"num_key_value_heads": 1, "vocab_size": 511}),
}


@pytest.fixture(scope="module")
def ranks() -> Iterator[GlooRanks]:
    pool = GlooRanks(2)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            family, overrides = CASES[name] if name in CASES else EXTRA_CASES[name]
            cache[name] = build_tiny_model(family, tmp_path_factory.mktemp(name), **overrides)
        return cache[name]

    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_matches_tp1(case: str, ranks: GlooRanks, checkpoints: Callable[[str], Path]) -> None:
    path = str(checkpoints(case))
    ref = run_rank(TPGroup.single(), path)
    results = ranks.run(run_rank, path)
    assert_ranks_identical(results)
    assert_same_run(results[0], ref)
    _, overrides = CASES[case]
    vocab = overrides.get("vocab_size", 512)
    assert results[0]["logits"].shape[-1] == vocab
    assert results[0]["empty_logits_shape"] == (0, vocab)
    arch = ModelArch.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    local_kv = max(1, arch.num_key_value_heads // 2)
    for result in results:
        assert result["num_local_kv_heads"] == result["kv_cache_heads"] == local_kv
    assert ref["kv_cache_heads"] == arch.num_key_value_heads


def test_tp2_dummy_weights_equal_tp1_dummy(
    ranks: GlooRanks, checkpoints: Callable[[str], Path]
) -> None:
    """Each rank draws the full TP=1 tensors from the seed and keeps its slice."""
    path = str(checkpoints("qwen2-tied-vocab511"))
    ref = run_rank(TPGroup.single(), path, "dummy")
    results = ranks.run(run_rank, path, "dummy")
    assert_ranks_identical(results)
    assert_same_run(results[0], ref)


# SmolLM2's head layout (9 query heads, 3 KV heads) splits over 3 ranks; 3 KV heads replicate
# over 6 ranks (6 query heads: one each; ranks 2k and 2k+1 share KV head k).
EXTRA_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm-heads-tp3": (
        "llama",
        {
            "hidden_size": 72,
            "intermediate_size": 96,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
        },
    ),
    "kv3-replicated-tp6": (
        "llama",
        {
            "hidden_size": 48,
            "intermediate_size": 96,
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
        },
    ),
}


@pytest.mark.parametrize(
    ("case", "world_size"), [("smollm-heads-tp3", 3), ("kv3-replicated-tp6", 6)]
)
def test_thread_ranks_match_tp1(
    case: str, world_size: int, checkpoints: Callable[[str], Path]
) -> None:
    path = str(checkpoints(case))
    ref = run_rank(TPGroup.single(), path)
    results = run_threads(world_size, path)
    assert_ranks_identical(results)
    assert_same_run(results[0], ref)
    assert all(r["kv_cache_heads"] == 1 for r in results)


# ----------------------------------------------------------------------------- splits
def test_split_heads_rule() -> None:
    even = split_heads(32, 8, 3, 4)
    assert (even.num_heads, even.num_kv_heads, even.head_start, even.kv_head_start) == (8, 2, 24, 6)
    # Fewer KV heads than ranks: each is replicated on tp // kv consecutive ranks.
    kv_of_rank = [split_heads(6, 3, r, 6).kv_head_start for r in range(6)]
    assert kv_of_rank == [0, 0, 1, 1, 2, 2]
    assert [split_heads(4, 1, r, 2).kv_head_start for r in range(2)] == [0, 0]
    assert split_heads(9, 3, 2, 3).num_kv_heads == 1


def _arch(**changes: Any) -> ModelArch:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 511,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    return ModelArch.from_hf_config({**base, **changes})


@pytest.mark.parametrize(
    ("changes", "tp_size", "match"),
    [
        ({}, 4, "6 attention heads"),
        ({"num_attention_heads": 9, "num_key_value_heads": 3}, 2, "9 attention heads"),
        ({"num_key_value_heads": 3}, 2, "3 KV heads"),
        ({"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 64}, 8, None),
        ({"num_attention_heads": 12, "num_key_value_heads": 3, "hidden_size": 48}, 4, "3 KV"),
        ({"intermediate_size": 97}, 2, "intermediate_size"),
    ],
)
def test_impossible_splits_name_the_flag(
    changes: dict[str, Any], tp_size: int, match: str | None
) -> None:
    arch = _arch(**changes)
    tp = TPGroup(0, tp_size)
    if match is None:  # a valid split (KV heads replicated twice) for contrast
        build_model(arch, CPU, torch.float32, 64, tp=tp)
        return
    with pytest.raises(ValueError, match=match) as err:
        build_model(arch, CPU, torch.float32, 64, tp=tp)
    assert FLAG in str(err.value)
    with pytest.raises(ValueError, match=FLAG):
        arch.check_tensor_parallel(tp_size)


def test_load_model_refuses_impossible_split_before_reading(
    checkpoints: Callable[[str], Path],
) -> None:
    path = checkpoints("qwen2-tied-vocab511")  # 6 heads
    with pytest.raises(ValueError, match=FLAG):
        load_model(ModelConfig(model=str(path)), CPU, torch.float32, tp=TPGroup(0, 4))


def test_runner_refuses_another_groups_model(checkpoints: Callable[[str], Path]) -> None:
    loaded = load_model(ModelConfig(model=str(checkpoints("llama"))), CPU, torch.float32)
    cache, scheduler = CacheConfig(num_gpu_blocks_override=4), SchedulerConfig(max_num_seqs=2)
    config = EngineConfig(cache=cache, scheduler=scheduler)
    with pytest.raises(ValueError, match="rank 0 of 2"):
        ModelRunner(loaded, RunnerSettings.from_config(config), CPU, tp=TPGroup(0, 2))


# ----------------------------------------------------------------------------- slice reads
class _SpyHandle:
    """Wraps a ``safe_open`` handle, counting the elements each tensor read returns."""

    def __init__(self, handle: Any, log: dict[str, list[tuple[str, int]]]) -> None:
        self._handle = handle
        self._log = log

    def __enter__(self) -> _SpyHandle:
        self._handle.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.__exit__(*exc)

    def keys(self) -> Any:
        return self._handle.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor: torch.Tensor = self._handle.get_tensor(name)
        self._log.setdefault(name, []).append(("full", tensor.numel()))
        return tensor

    def get_slice(self, name: str) -> Any:
        return _SpySlice(self._handle.get_slice(name), name, self._log)


class _SpySlice:
    def __init__(self, inner: Any, name: str, log: dict[str, list[tuple[str, int]]]) -> None:
        self._inner, self._name, self._log = inner, name, log

    def get_shape(self) -> Any:
        return self._inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor: torch.Tensor = self._inner[index]
        self._log.setdefault(self._name, []).append(("slice", tensor.numel()))
        return tensor


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_reads_only_its_slices(
    rank: int, checkpoints: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank r of 2 (no collectives are needed to load) reads half of every split tensor
    through ``get_slice`` (the whole of a replicated KV head, norms), never a full copy of a
    split tensor, and holds exactly the right slices (padding rows zero)."""
    import safetensors

    path = checkpoints("llama-kv1-vocab511")  # 4 heads, 1 KV head, untied, vocab 511
    log: dict[str, list[tuple[str, int]]] = {}
    real_open = safetensors.safe_open
    monkeypatch.setattr(
        safetensors, "safe_open", lambda *a, **k: _SpyHandle(real_open(*a, **k), log)
    )
    loaded = load_model(ModelConfig(model=str(path)), CPU, torch.float32, tp=TPGroup(rank, 2))
    monkeypatch.undo()
    full = load_file(path / "model.safetensors")
    assert log.keys() == full.keys()
    split_markers = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed", "lm_head")
    read_total = 0
    for name, reads in log.items():
        kinds = {kind for kind, _ in reads}
        count = sum(n for _, n in reads)
        read_total += count
        if any(marker in name for marker in split_markers):
            assert kinds == {"slice"}, name
            rows = full[name].shape[0]  # a padded vocab share is ceil(rows / 2) rows
            assert count <= -(-rows // 2) * (full[name].numel() // rows), name
        elif "k_proj" in name or "v_proj" in name:
            assert count == full[name].numel(), name  # the one KV head, replicated
        else:
            assert count == full[name].numel(), name  # norms
    assert read_total < 0.6 * sum(t.numel() for t in full.values())

    model = loaded.model
    params = dict(model.named_parameters())
    half = lambda n: slice(rank * n // 2, (rank + 1) * n // 2)  # noqa: E731
    emb = params["model.embed_tokens.weight"]
    rows = full["model.embed_tokens.weight"][rank * 256 : (rank + 1) * 256]
    assert torch.equal(emb[: rows.shape[0]], rows)
    assert emb.shape[0] == 256 and torch.count_nonzero(emb[rows.shape[0] :]) == 0
    pre = "model.layers.0."
    q, k, v = (full[f"{pre}self_attn.{p}_proj.weight"] for p in "qkv")
    want_qkv = torch.cat([q[half(q.shape[0])], k, v])
    assert torch.equal(params[f"{pre}self_attn.qkv_proj.weight"], want_qkv)
    o = full[f"{pre}self_attn.o_proj.weight"]
    assert torch.equal(params[f"{pre}self_attn.o_proj.weight"], o[:, half(o.shape[1])])
    gate, up = full[f"{pre}mlp.gate_proj.weight"], full[f"{pre}mlp.up_proj.weight"]
    want = torch.cat([gate[half(gate.shape[0])], up[half(up.shape[0])]])
    assert torch.equal(params[f"{pre}mlp.gate_up_proj.weight"], want)


def test_tp1_loads_every_tensor_whole(
    checkpoints: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=1 keeps today's path: every tensor read once, whole (``get_tensor``)."""
    import safetensors

    path = checkpoints("llama")
    log: dict[str, list[tuple[str, int]]] = {}
    real_open = safetensors.safe_open
    monkeypatch.setattr(
        safetensors, "safe_open", lambda *a, **k: _SpyHandle(real_open(*a, **k), log)
    )
    load_model(ModelConfig(model=str(path)), CPU, torch.float32)
    monkeypatch.undo()
    assert all(reads and {kind for kind, _ in reads} == {"full"} for reads in log.values())
