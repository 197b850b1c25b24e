"""FP8 (e4m3) KV cache kernels: store_kv and paged attention, Triton against the torch reference.

Like ``test_kernels_triton`` (whose batch builders this reuses, and whose import sets up the
CPU interpreter), the Triton kernels run under the interpreter without CUDA and compiled with
it. Three comparisons per attention batch:

- Triton vs the torch reference on the same fp8 cache: both read the same e4m3 values, so they
  agree to float32 rounding (rtol 1e-4, atol 1e-5, as for unquantized caches);
- the reference vs the dense float32 oracle on the same fp8 cache (de-quantized element by
  element): the same tolerance;
- fp8 vs the unquantized float32 cache: e4m3 keeps 3 mantissa bits, so every stored element is
  within 2^-4 of its value (relative); on these N(0, 1) batches the outputs stay within 8% of
  the largest output and the rms error within 5% of the rms output (observed: <= 6.2% and
  <= 3.7%, scale 1.0 or not).
"""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import ATTENTION_CASES, DEVICE, ON_CUDA, make_attention_batch, new_gen, rand

from tokenwire.kernels.kv_quant import FP8_E4M3_MAX, FP8_KV_DTYPE, quantize_fp8
from tokenwire.kernels.paged_attention import paged_attention_dense_ref, paged_attention_ref
from tokenwire.kernels.paged_attention_triton import paged_attention_triton
from tokenwire.kernels.store_kv import store_kv_ref
from tokenwire.kernels.store_kv_triton import store_kv_triton


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def scale(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device=DEVICE)


def e4m3_ties() -> torch.Tensor:
    """Every midpoint between two adjacent finite positive e4m3 values, and its negation."""
    codes = torch.arange(0, 127, dtype=torch.uint8, device=DEVICE)  # 0 .. 448; 127 is NaN
    values = codes.view(FP8_KV_DTYPE).float()
    mids = (values[:-1] + values[1:]) / 2
    return torch.cat([mids, -mids])


def test_store_quantizes_like_torch_rounds_ties_to_even_and_saturates() -> None:
    """Triton's stored bytes equal torch's ``(x / scale).clamp(+-448).to(e4m3)`` for random
    values of every magnitude, every rounding tie, values past +-448 * scale; padding rows
    (slot -1) and the null block stay untouched."""
    gen = new_gen(0)
    num_tokens, hkv, d = 12, 4, 64
    qkv = rand(num_tokens, 5 * hkv * d, gen=gen)
    magnitudes = torch.logspace(-4, 3, num_tokens, device=DEVICE)[:, None]
    qkv *= magnitudes  # rows from 1e-4 to 1e3: subnormals, normals, saturation
    key = qkv[:, : hkv * d].view(num_tokens, hkv, d)  # strided, as in the model
    value = qkv[:, 2 * hkv * d : 3 * hkv * d].view(num_tokens, hkv, d)
    k_scale, v_scale = scale(0.37), scale(2.0)
    ties = e4m3_ties()  # times a power-of-two scale: x / scale is exactly each tie
    value[0].view(-1)[: ties.numel()] = ties * v_scale
    slots = torch.tensor([17, 33, -1, 40, 41, -1, 18, 63, 16, 30, 50, 21], device=DEVICE)
    caches = [torch.zeros(4, 16, hkv, d, dtype=FP8_KV_DTYPE, device=DEVICE) for _ in range(2)]
    ref = [c.clone() for c in caches]
    store_kv_triton(key, value, *caches, slots, k_scale, v_scale)
    store_kv_ref(key, value, *ref, slots, k_scale, v_scale)
    for got, want in zip(caches, ref, strict=True):
        assert torch.equal(got.float(), want.float())  # values: +0 and -0 may differ in sign
    flat = caches[0].view(-1, hkv, d).float()
    kept = slots >= 0
    want_k = (key[kept] / k_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE).float()
    assert torch.equal(flat[slots[kept]], want_k)
    assert flat.abs().max() == FP8_E4M3_MAX  # the 1e3-magnitude rows saturate, never NaN
    assert not flat.isnan().any()
    written = torch.zeros(flat.shape[0], dtype=torch.bool, device=DEVICE)
    written[slots[kept]] = True
    assert not flat[~written].any()  # null block (slots 0-15) and every other slot untouched


def fp8_batch(
    shape: list[tuple[int, int]], hq: int, hkv: int, k_scale: float, v_scale: float, **kw: int
) -> tuple[torch.Tensor, ...]:
    """A float32 batch (``make_attention_batch``) and the same cache stored as fp8.

    Quantizing the whole float cache equals storing this step's K/V with ``store_kv`` into an
    fp8 cache whose stale entries were quantized too (quantization is elementwise)."""
    query, key, value, k_cache, v_cache, meta = make_attention_batch(shape, hq, hkv, 64, **kw)
    ks, vs = scale(k_scale), scale(v_scale)
    return query, key, value, k_cache, v_cache, quantize_fp8(k_cache, ks),\
        quantize_fp8(v_cache, vs), ks, vs, meta  # fmt: skip


def check_fp8_attention(
    shape: list[tuple[int, int]],
    hq: int,
    hkv: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    padding_rows: int = 0,
    **tiles: int,
) -> None:
    batch = fp8_batch(shape, hq, hkv, k_scale, v_scale, padding_rows=padding_rows)
    query, key, value, k_cache, v_cache, k8, v8, ks, vs, meta = batch
    sm_scale = 64**-0.5
    out = paged_attention_triton(query, k8, v8, meta, sm_scale, ks, vs, **tiles)
    oracle = paged_attention_dense_ref(query, k8, v8, meta, sm_scale, ks, vs)
    torch.testing.assert_close(out, oracle, rtol=1e-4, atol=1e-5)
    if DEVICE.type == "cpu":  # the batched reference plans on the host (CPU engine path)
        ref = paged_attention_ref(query, key, value, k8, v8, meta, sm_scale, ks, vs)
        torch.testing.assert_close(ref, oracle, rtol=1e-4, atol=1e-5)
    exact = paged_attention_dense_ref(query, k_cache, v_cache, meta, sm_scale)
    err = out - exact
    assert err.abs().max() <= 0.08 * exact.abs().max()
    assert err.pow(2).mean().sqrt() <= 0.05 * exact.pow(2).mean().sqrt()
    if padding_rows:
        assert not out[meta.num_tokens - padding_rows :].any()


@pytest.mark.parametrize("case", ["decode", "fresh_prefill", "prefix_hit", "chunked_prefill"])
def test_fp8_attention_cases_smollm_heads(case: str) -> None:
    check_fp8_attention(ATTENTION_CASES[case], 9, 3, k_scale=0.5, v_scale=0.25)


@pytest.mark.parametrize(
    ("heads", "scales"),
    [((8, 2), (1.0, 1.0)), ((8, 1), (0.05, 3.0)), ((4, 4), (2.0, 0.1))],
    ids=["8q2kv-unit", "8q1kv", "4q4kv"],
)
def test_fp8_attention_mixed_batch(heads: tuple[int, int], scales: tuple[float, float]) -> None:
    """Decodes, fresh prefills, prefix hits and a 1-token prefill in one batch, plus padding,
    over shuffled block tables with holes (``make_attention_batch``)."""
    check_fp8_attention(ATTENTION_CASES["mixed"], *heads, *scales, padding_rows=3)


def test_fp8_attention_small_tiles_and_splits() -> None:
    """Tiles straddling KV blocks of 16 and several decode splits with fp8 tiles."""
    check_fp8_attention(ATTENTION_CASES["mixed"], 6, 2, 0.5, 0.5, block_m=16, block_n=16,
                        num_splits=3)  # fmt: skip


def test_fp8_store_then_attend_through_the_dispatchers() -> None:
    """The model's call sequence (``store_kv`` then ``paged_attention``, both dispatching to
    Triton here) equals the torch reference pair on a fresh fp8 cache."""
    from tokenwire.kernels.paged_attention import paged_attention
    from tokenwire.kernels.store_kv import store_kv

    query, key, value, _, _, meta = make_attention_batch(ATTENTION_CASES["mixed"], 8, 2, 64)
    num_blocks = int(meta.block_tables.max()) + 1
    ks, vs = scale(0.25), scale(0.5)
    out = []
    for triton_on in (True, False):
        caches = [torch.zeros(num_blocks, 16, 2, 64, dtype=FP8_KV_DTYPE, device=DEVICE)
                  for _ in range(2)]  # fmt: skip
        if triton_on:
            store_kv(key, value, *caches, meta.slot_mapping, ks, vs)
            out.append(paged_attention(query, key, value, *caches, meta, 0.125, ks, vs))
        else:
            store_kv_ref(key, value, *caches, meta.slot_mapping, ks, vs)
            out.append(paged_attention_dense_ref(query, *caches, meta, 0.125, ks, vs))
    torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-5)


def test_scales_are_ignored_for_an_unquantized_cache() -> None:
    query, key, value, k_cache, v_cache, meta = make_attention_batch(
        ATTENTION_CASES["mixed"], 8, 2, 64
    )
    plain = paged_attention_triton(query, k_cache, v_cache, meta, 0.125)
    scaled = paged_attention_triton(query, k_cache, v_cache, meta, 0.125, scale(3.0), scale(3.0))
    assert torch.equal(plain, scaled)
    if DEVICE.type == "cpu":
        ref = paged_attention_ref(query, key, value, k_cache, v_cache, meta, 0.125, scale(3.0))
        torch.testing.assert_close(ref, plain, rtol=1e-4, atol=1e-5)
