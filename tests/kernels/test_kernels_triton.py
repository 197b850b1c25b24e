"""Every Triton kernel against its torch reference, on CPU (interpreter) or CUDA (compiled).

Without CUDA the kernels run under Triton's CPU interpreter on small float32 shapes: the root
conftest defines every kernel interpreted before any test module is imported
(tests/support/interpreted_kernels.py: ``triton.jit`` picks interpreted or compiled when a
kernel is defined), and a fixture sets ``TRITON_INTERPRET=1`` per test for the dispatch,
which reads it at call time; a process-wide switch would send every other test's CPU model
run through the (slow, not bit-identical) interpreter. With CUDA the same tests run
compiled on the GPU, and the ``gpu``-marked tests add large bf16 shapes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

# The reference modules above never import triton. Everything below this switch does.
from kernel_inputs import (
    ATTENTION_CASES,
    DECODES,
    DEVICE,
    ON_CUDA,
    make_attention_batch,
    new_gen,
    rand,
)

from tokenwire.kernels import cuda_graph_buckets as buckets
from tokenwire.kernels.activation import silu_and_mul_ref
from tokenwire.kernels.activation_triton import silu_and_mul_triton
from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.dispatch import use_triton
from tokenwire.kernels.paged_attention import paged_attention_dense_ref, paged_attention_ref
from tokenwire.kernels.paged_attention_triton import paged_attention_triton
from tokenwire.kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref
from tokenwire.kernels.rmsnorm_triton import (
    fused_add_rms_norm_triton,
    rms_norm_triton,
)
from tokenwire.kernels.rotary import apply_rotary_ref, build_cos_sin_cache, compute_inv_freq
from tokenwire.kernels.rotary_triton import apply_rotary_triton
from tokenwire.kernels.store_kv import store_kv_ref
from tokenwire.kernels.store_kv_triton import store_kv_triton
from tokenwire.runtime.outputs import CompletionOutput, RequestOutput

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch (``use_triton``) sees the interpreter switch only inside this module's tests."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    """Max abs error within ``rtol`` of the reference's largest magnitude."""
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= rtol * max(ref.float().abs().max().item(), 1e-6), err


# --- elementwise kernels -------------------------------------------------------------------


def test_store_kv_skips_padding_and_reads_strided_rows() -> None:
    gen = new_gen(0)
    num_tokens, hkv, d = 9, 3, 64
    qkv = rand(num_tokens, 5 * hkv * d + 7, gen=gen)  # k/v are strided views, as in the model
    key = qkv[:, : hkv * d].view(num_tokens, hkv, d)
    value = qkv[:, hkv * d : 2 * hkv * d].view(num_tokens, hkv, d)
    slots = torch.tensor([17, 3, -1, 40, 41, -1, 8, 63, 16], device=DEVICE)
    caches = [rand(4, 16, hkv, d, gen=gen) for _ in range(2)]
    ref = [c.clone() for c in caches]
    store_kv_triton(key, value, *caches, slots)
    store_kv_ref(key, value, *ref, slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


@pytest.mark.parametrize("hidden", [48, 576])
def test_rms_norm_plain_and_fused(hidden: int) -> None:
    gen = new_gen(1)
    x, residual = rand(3, 5, hidden, gen=gen), rand(3, 5, hidden, gen=gen)
    weight = 1.0 + 0.1 * rand(hidden, gen=gen)
    assert_rel_close(rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), 1e-5)
    out, new_residual = fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, ref_residual)
    assert_rel_close(out, ref_out, 1e-5)


@pytest.mark.parametrize(("head_dim", "scaling"), [(64, None), (128, LLAMA3)])
def test_rotary_matches_reference(head_dim: int, scaling: dict[str, object] | None) -> None:
    gen = new_gen(2)
    inv_freq = compute_inv_freq(head_dim, 500000.0, scaling)
    cache = build_cos_sin_cache(inv_freq, 4096, torch.float32).to(DEVICE)
    hq, hkv, num_tokens = 9, 3, 6
    qkv = rand(num_tokens, (hq + 2 * hkv) * head_dim, gen=gen)
    q = qkv[:, : hq * head_dim].view(num_tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(num_tokens, hkv, head_dim)
    positions = torch.tensor([0, 1, 4095, 17, 3000, 100], device=DEVICE)
    for out, ref in zip(
        apply_rotary_triton(q, k, positions, cache),
        apply_rotary_ref(q, k, positions, cache),
        strict=True,
    ):
        assert_rel_close(out, ref, 1e-5)


@pytest.mark.parametrize("inter", [96, 1500])
def test_silu_and_mul_matches_reference(inter: int) -> None:
    x = rand(2, 3, 2 * inter, gen=new_gen(3))
    assert_rel_close(silu_and_mul_triton(x), silu_and_mul_ref(x), 1e-5)


# --- paged attention -----------------------------------------------------------------------


def check_attention(shape: Sequence[tuple[int, int]], hq: int, hkv: int, **kwargs: int) -> None:
    """Triton equals the torch reference (float32) on one batch."""
    head_dim = kwargs.pop("head_dim", 64)
    block_size = kwargs.pop("block_size", 16)
    padding_rows = kwargs.pop("padding_rows", 0)
    batch = make_attention_batch(shape, hq, hkv, head_dim, block_size, padding_rows)
    query, key, value, k_cache, v_cache, meta = batch
    scale = head_dim**-0.5
    out = paged_attention_triton(query, k_cache, v_cache, meta, scale, **kwargs)
    if DEVICE.type == "cpu":
        ref = paged_attention_ref(query, key, value, k_cache, v_cache, meta, scale)
    else:  # the batched reference gathers through host numpy plans; the oracle is simpler
        ref = paged_attention_dense_ref(query, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    if padding_rows:
        assert not out[meta.num_tokens - padding_rows :].any()


@pytest.mark.parametrize(
    "heads", [(4, 4), (8, 2), (8, 1), (9, 3)], ids=lambda h: f"{h[0]}q{h[1]}kv"
)
def test_attention_mixed_batch_gqa_ratios(heads: tuple[int, int]) -> None:
    """Decodes, a fresh prefill, prefix hits and a 1-token prefill row, plus padding rows."""
    check_attention(ATTENTION_CASES["mixed"], *heads, padding_rows=3)


@pytest.mark.parametrize("case", ["decode", "fresh_prefill", "prefix_hit", "chunked_prefill"])
def test_attention_cases_smollm_heads(case: str) -> None:
    check_attention(ATTENTION_CASES[case], 9, 3)


def test_attention_head_dim_128_block_size_32() -> None:
    check_attention(ATTENTION_CASES["mixed"], 8, 2, head_dim=128, block_size=32)


def test_attention_small_tiles_cross_block_and_query_tile_boundaries() -> None:
    """16-wide tiles: several query tiles per prefill (BLOCK_Q = 16 // 3 = 5 tokens, one
    masked row), several key tiles per decode split, tiles straddling KV blocks of 8."""
    check_attention(ATTENTION_CASES["mixed"], 6, 2, block_size=8, block_m=16, block_n=16)


@pytest.mark.parametrize(
    ("window", "soft_cap"), [(7, None), (16, None), (40, 2.0), (None, 2.0)],
    ids=["w7", "w16", "w40-cap", "cap"],
)  # fmt: skip
def test_attention_sliding_window_and_soft_cap(window: int | None, soft_cap: float | None) -> None:
    """Windows shorter than, equal to and spanning several blocks, against the dense oracle:
    decodes read only their last ``window`` keys, prefill chunks and prefix hits mask
    ``q - window < k <= q``; the soft-cap bites (scores of ~10 capped at 2). Small tiles so
    the windowed key walks start inside a tile and cross KV blocks; the batched CPU
    reference (windowed plans) is checked against the same oracle."""
    batch = make_attention_batch(ATTENTION_CASES["mixed"], 6, 2, 32, block_size=8)
    query, key, value, k_cache, v_cache, meta = batch
    query = query * 3.0  # larger logits, so the cap changes the result
    kwargs = {"logits_soft_cap": soft_cap, "sliding_window": window}
    oracle = paged_attention_dense_ref(query, k_cache, v_cache, meta, 0.25, **kwargs)
    out = paged_attention_triton(
        query, k_cache, v_cache, meta, 0.25, block_m=16, block_n=16, num_splits=3, **kwargs
    )
    torch.testing.assert_close(out, oracle, rtol=1e-4, atol=1e-5)
    if window is not None:  # the mask matters: full attention differs from the oracle
        full = paged_attention_dense_ref(query, k_cache, v_cache, meta, 0.25, soft_cap)
        assert not torch.allclose(full, oracle, rtol=1e-3, atol=1e-3)
    if DEVICE.type == "cpu":
        ref = paged_attention_ref(query, key, value, k_cache, v_cache, meta, 0.25, **kwargs)
        torch.testing.assert_close(ref, oracle, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_split_kv(num_splits: int) -> None:
    """1 split (no merging), 3 (uneven), 8 (splits past the end of short contexts: empty)."""
    check_attention(DECODES, 8, 2, num_splits=num_splits, block_n=16)


def test_decode_padded_to_cuda_graph_bucket() -> None:
    """Rows padded as a decode CUDA-graph replay pads them (``write_padded_decode``: seq_len 0,
    slot -1) attend to nothing and give zeros; real rows are unchanged. As in a replay, the
    static block-table buffer keeps stale block ids past each real row's blocks and in the
    padded rows: attention must never read them."""
    from tokenwire.runtime.worker.cuda_graphs import write_padded_decode
    from tokenwire.runtime.worker.input_batch import StepArrays

    query, _, _, k_cache, v_cache, meta = make_attention_batch(DECODES, 8, 2, 64)
    n = len(DECODES)
    bucket = buckets.padded_batch_size(n, buckets.decode_batch_buckets(16))
    assert bucket == 8
    tables = meta.block_tables.cpu().numpy()
    arrays = StepArrays(
        input_ids=np.zeros(n, dtype=np.int64), positions=np.zeros(n, dtype=np.int64),
        slot_mapping=meta.slot_mapping.cpu().numpy(), query_start_loc=meta.query_start_loc_np,
        seq_lens=meta.seq_lens_np, block_tables=tables, num_decodes=n, max_query_len=1,
        max_seq_len=meta.max_seq_len,
    )  # fmt: skip
    # Every buffer holds an earlier step's values; padding must neutralise them all.
    host = {name: np.full(bucket, 3, dtype=np.int64)
            for name in ("input_ids", "positions", "slot_mapping")}  # fmt: skip
    host["seq_lens"] = np.full(bucket, 3, dtype=np.int32)
    write_padded_decode(host, arrays, bucket)
    stale = torch.Generator().manual_seed(5)
    static_tables = torch.randint(1, k_cache.shape[0], (bucket, 32), generator=stale)
    static_tables = static_tables.to(torch.int32)
    static_tables[:n, : tables.shape[1]] = torch.from_numpy(tables)
    query_start_loc = np.arange(bucket + 1, dtype=np.int32)  # constant in the static buffers
    padded_meta = AttentionMetadata(
        num_tokens=bucket,
        num_seqs=bucket,
        num_decodes=bucket,
        block_size=meta.block_size,
        slot_mapping=torch.from_numpy(host["slot_mapping"]).to(DEVICE),
        query_start_loc=torch.from_numpy(query_start_loc).to(DEVICE),
        seq_lens=torch.from_numpy(host["seq_lens"]).to(DEVICE),
        block_tables=static_tables.to(DEVICE),
        max_query_len=1,
        max_seq_len=meta.max_seq_len,
        query_start_loc_np=query_start_loc,
        seq_lens_np=host["seq_lens"],
    )
    padded_query = torch.cat([query, rand(3, 8, 64, gen=new_gen(9))])
    out = paged_attention_triton(padded_query, k_cache, v_cache, padded_meta, 0.125, num_splits=4)
    ref = paged_attention_triton(query, k_cache, v_cache, meta, 0.125, num_splits=4)
    torch.testing.assert_close(out[:5], ref, rtol=0, atol=0)
    assert not out[5:].any()


# --- dispatch and end to end ---------------------------------------------------------------


def test_dispatch_uses_triton_only_on_cuda_or_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(cpu)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not use_triton(cpu)  # the CPU engine's hot path: the torch reference


def test_runtime_imports_without_loading_triton() -> None:
    code = (
        "import sys, tokenwire.runtime.llm, tokenwire.runtime.models.llama;"
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_gpu() -> None:
    """The interpreter checks what the kernels compute; this checks that they lower through
    Triton's compiler to a cubin for sm_90 (bf16, fp8 caches, float32, model shapes, every
    window / soft-cap / MoE tile variant) within sm_90's shared memory, which needs no GPU,
    and that every kernel of the covered modules is among them. It caught what the
    interpreter accepts: a jitted function reading a non-constexpr global."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_compile_check.py")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]


def test_engine_greedy_tokens_equal_torch_path(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny Llama (4 q / 2 kv heads) through the engine: a prefix hit (shared prefix), chunked
    prefill (32-token budget) and mixed decode+prefill steps. The Triton path (interpreter on
    CPU, compiled on CUDA) gives the torch CPU path's greedy tokens and logprobs."""
    from tokenwire.kernels import paged_attention_triton as pat
    from tokenwire.runtime.llm import LLM
    from tokenwire.runtime.sampling_params import SamplingParams

    model = str(tiny_model_factory("llama"))
    prefix = [(7 * j) % 500 + 3 for j in range(20)]
    prompts = [prefix + [(13 * i + j) % 500 + 3 for j in range(3 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)

    def run(device: str) -> list[RequestOutput]:
        llm = LLM(model, device=device, max_num_batched_tokens=32, max_num_seqs=4)
        return llm.generate(prompts, params, use_tqdm=False)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch_run = run("cpu")
    calls: list[int] = []
    original = pat.paged_attention_triton
    monkeypatch.setattr(
        pat, "paged_attention_triton", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_run = run(DEVICE.type)
    assert calls, "the Triton attention path did not run"
    assert triton_run[2].num_cached_tokens > 0  # the prefix hit happened
    for out, ref in zip(triton_run, torch_run, strict=True):
        ids, lps = _tokens_and_logprobs(out.outputs[0])
        ref_ids, ref_lps = _tokens_and_logprobs(ref.outputs[0])
        assert ids == ref_ids
        np.testing.assert_allclose(lps, ref_lps, atol=1e-4 if DEVICE.type == "cpu" else 1e-3)


def _tokens_and_logprobs(completion: CompletionOutput) -> tuple[list[int], list[float]]:
    assert completion.logprobs is not None
    ids = list(completion.token_ids)
    return ids, [pos[tok].logprob for pos, tok in zip(completion.logprobs, ids, strict=True)]


# --- GPU: compiled kernels at model shapes, bf16 against a float32 reference ---------------

# (q heads, kv heads, head_dim), num_splits (None = default), block_size.
GPU_ATTENTION = [
    ((32, 8, 128), None, 16),  # Llama-3.1-8B
    ((32, 8, 128), 1, 16),
    ((32, 8, 128), 16, 32),
    ((9, 3, 64), None, 16),  # SmolLM2-135M
    ((16, 8, 128), None, 32),  # Qwen3-0.6B
]


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize(("heads", "num_splits", "block_size"), GPU_ATTENTION)
@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_gpu_attention_bf16(
    heads: tuple[int, int, int], num_splits: int | None, block_size: int
) -> None:
    """64 decodes up to 4k context, a 1k fresh prefill, a 512-token prefix hit on 1.5k cached,
    a mid chunk, and padding rows: bf16 kernels vs the float32 oracle on the same inputs."""
    gen = new_gen(11)
    decode_lens = torch.randint(1, 4096, (64,), generator=gen, device=DEVICE).tolist()
    shape = [(1, n) for n in decode_lens] + [(1024, 1024), (512, 2048), (256, 768), (1, 300)]
    hq, hkv, d = heads
    query, _, _, k_cache, v_cache, meta = make_attention_batch(
        shape, hq, hkv, d, block_size, padding_rows=5, dtype=torch.bfloat16
    )
    out = paged_attention_triton(query, k_cache, v_cache, meta, d**-0.5, num_splits=num_splits)
    ref = paged_attention_dense_ref(query.float(), k_cache.float(), v_cache.float(), meta, d**-0.5)
    assert rel_l2(out, ref) < 1e-2
    assert not out[-5:].any()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_gpu_elementwise_kernels_bf16() -> None:
    gen = new_gen(12)
    bf16 = torch.bfloat16
    x, res = rand(257, 4096, gen=gen, dtype=bf16), rand(257, 4096, gen=gen, dtype=bf16)
    w = (1.0 + 0.1 * rand(4096, gen=gen)).to(bf16)
    out, new_res = fused_add_rms_norm_triton(x, res, w, 1e-5)
    ref_out, ref_res = fused_add_rms_norm_ref(x.float(), res.float(), w.float(), 1e-5)
    assert rel_l2(new_res, ref_res) < 1e-2 and rel_l2(out, ref_out) < 1e-2
    assert rel_l2(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x.float(), w.float(), 1e-5)) < 1e-2
    gate_up = rand(257, 2 * 14336, gen=gen, dtype=bf16)
    assert rel_l2(silu_and_mul_triton(gate_up), silu_and_mul_ref(gate_up.float())) < 1e-2
    cache = build_cos_sin_cache(compute_inv_freq(128, 500000.0, LLAMA3), 8192, torch.float32)
    q, k = rand(300, 32, 128, gen=gen, dtype=bf16), rand(300, 8, 128, gen=gen, dtype=bf16)
    positions = torch.randint(0, 8192, (300,), generator=gen, device=DEVICE)
    got = apply_rotary_triton(q, k, positions, cache.to(DEVICE, bf16))
    want = apply_rotary_ref(q.float(), k.float(), positions, cache.to(DEVICE))
    assert rel_l2(got[0], want[0]) < 1e-2 and rel_l2(got[1], want[1]) < 1e-2
    slots = torch.randperm(4096, generator=gen, device=DEVICE)[:300]
    slots[::7] = -1
    caches = [torch.zeros(256, 16, 8, 128, dtype=bf16, device=DEVICE) for _ in range(4)]
    store_kv_triton(k, q[:, :8], caches[0], caches[1], slots)
    store_kv_ref(k, q[:, :8], caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_gpu_decode_cuda_graph_replay_follows_new_lengths() -> None:
    """The decode grid does not depend on context lengths: a graph captured once replays
    correctly after seq_lens and block tables change in place."""
    shape = [(1, n) for n in (700, 33, 2000, 5, 1500, 64, 1, 999)]
    query, _, _, k_cache, v_cache, meta = make_attention_batch(
        shape, 32, 8, 128, dtype=torch.bfloat16
    )
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    paged_attention_triton(query, k_cache, v_cache, meta, 0.088)  # compile before capture
    with torch.cuda.graph(graph):
        out = paged_attention_triton(query, k_cache, v_cache, meta, 0.088)
    meta.seq_lens.copy_(torch.flip(meta.seq_lens, [0]))
    meta.block_tables.copy_(torch.flip(meta.block_tables, [0]))
    graph.replay()
    eager = paged_attention_triton(query, k_cache, v_cache, meta, 0.088)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
