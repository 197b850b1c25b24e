"""Compile the Triton kernels for an NVIDIA target without a GPU (run as a script).

The interpreter checks what the kernels compute, not whether they lower: this runs each
kernel wrapper at model shapes with launches intercepted, then compiles every intercepted
launch through Triton's full pipeline (TTIR -> TTGIR -> PTX -> cubin with the bundled ptxas)
for sm_90. Exit status 1 and the compiler's message when a kernel does not compile. Uses
``ASTSource``/``GPUTarget``, present in Triton 3.6 to 3.9. Must run without
``TRITON_INTERPRET`` (the kernels must be ``JITFunction``s).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

_PTR_TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
}
# Hopper's largest shared-memory allocation per block (227 KiB): a kernel asking more
# compiles but fails at launch with OutOfResources.
SM90_MAX_SHARED = 232_448
Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]


def capture_launches() -> list[Launch]:
    """Run each wrapper once on CPU tensors; record ``(kernel, args, kwargs)`` per launch."""
    launches: list[Launch] = []
    JITFunction.__getitem__ = lambda self, grid: (  # type: ignore[method-assign]
        lambda *args, **kwargs: launches.append((self, args, kwargs))
    )
    _attention_launches()
    _mla_launches()
    _elementwise_launches()
    _moe_launches()
    _moe_mxfp4_launches()
    return launches


def _attention_launches() -> None:
    """bf16 at model head shapes; Mistral's window, Gemma 2's head_dim 256 with window and
    soft cap, Llama 4's attention chunk, gpt-oss's sinks (with and without its window), an
    fp8 cache with scales, and float32 (the GPU check's parity stage; a tiny gpt-oss)."""
    from tokenwire.kernels.attention_metadata import AttentionMetadata
    from tokenwire.kernels.paged_attention_triton import paged_attention_triton

    qsl = torch.tensor([0, 1, 2, 12], dtype=torch.int32)
    meta = AttentionMetadata(
        num_tokens=12, num_seqs=3, num_decodes=2, block_size=16,
        slot_mapping=torch.arange(12), query_start_loc=qsl,
        seq_lens=torch.tensor([5, 40, 30], dtype=torch.int32),
        block_tables=torch.ones(3, 4, dtype=torch.int32), max_query_len=10, max_seq_len=40,
        query_start_loc_np=qsl.numpy(), seq_lens_np=qsl.numpy(),
    )  # fmt: skip
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    scales = torch.ones(1), torch.ones(1)
    cases: list[tuple[tuple[int, int, int], torch.dtype, torch.dtype, dict[str, Any]]] = [
        ((32, 8, 128), bf16, bf16, {}),  # Llama-3.1-8B
        ((9, 3, 64), bf16, bf16, {}),  # SmolLM2-135M
        ((32, 8, 128), bf16, bf16, {"sliding_window": 4096}),  # Mistral-7B
        ((8, 4, 256), bf16, bf16, {"sliding_window": 4096, "logits_soft_cap": 50.0}),
        ((8, 4, 256), bf16, bf16, {}),  # Gemma 2's global layers
        ((32, 8, 128), bf16, fp8, {"k_scale": scales[0], "v_scale": scales[1]}),
        ((4, 2, 32), torch.float32, torch.float32, {}),  # the parity stage's tiny Llama
        ((4, 2, 64), torch.float32, torch.float32, {"sliding_window": 12}),
        ((40, 8, 128), bf16, bf16, {"attention_chunk": 8192}),  # Llama 4 Scout
        ((64, 8, 64), bf16, bf16, {"sliding_window": 128, "sinks": torch.empty(64, dtype=bf16)}),
        ((64, 8, 64), bf16, bf16, {"sinks": torch.empty(64, dtype=bf16)}),  # gpt-oss-20b
        ((4, 2, 16), torch.float32, torch.float32, {"sliding_window": 8, "sinks": torch.empty(4)}),
    ]
    for (hq, hkv, d), dtype, cache_dtype, extra in cases:
        cache = torch.empty(8, 16, hkv, d, dtype=cache_dtype)
        query = torch.empty(12, hq, d, dtype=dtype)
        paged_attention_triton(query, cache, cache, meta, 0.1, **extra)


def _mla_launches() -> None:
    """MLA over the latent cache (decode kernel + the generic prefill at 576 features):
    DeepSeek-V2-Lite (16 heads), V3 under TP=2 (64 heads; 128: two head groups), an fp8
    cache, and the float32 tiny DeepSeek of the interpreter tests (32 + 8 features)."""
    from tokenwire.kernels.attention_metadata import AttentionMetadata
    from tokenwire.kernels.mla_decode_triton import mla_attention_triton

    qsl = torch.tensor([0, 1, 2, 12], dtype=torch.int32)
    meta = AttentionMetadata(
        num_tokens=12, num_seqs=3, num_decodes=2, block_size=64,
        slot_mapping=torch.arange(12), query_start_loc=qsl,
        seq_lens=torch.tensor([5, 40, 30], dtype=torch.int32),
        block_tables=torch.ones(3, 4, dtype=torch.int32), max_query_len=10, max_seq_len=40,
        query_start_loc_np=qsl.numpy(), seq_lens_np=qsl.numpy(),
    )  # fmt: skip
    bf16 = torch.bfloat16
    cases = [
        (16, 512, 64, bf16, bf16),
        (64, 512, 64, bf16, bf16),
        (128, 512, 64, bf16, bf16),
        (16, 512, 64, bf16, torch.float8_e4m3fn),
        (4, 32, 8, torch.float32, torch.float32),
    ]
    for heads, lora, rope, dtype, cache_dtype in cases:
        cache = torch.empty(8, 64, 1, lora + rope, dtype=cache_dtype)
        query = torch.empty(12, heads, lora + rope, dtype=dtype)
        scale = torch.ones(1) if cache_dtype == torch.float8_e4m3fn else None
        mla_attention_triton(query, cache, meta, 0.1, lora, scale)


def _elementwise_launches() -> None:
    from tokenwire.kernels.activation_triton import gelu_tanh_and_mul_triton, silu_and_mul_triton
    from tokenwire.kernels.rmsnorm_triton import fused_add_rms_norm_triton, rms_norm_triton
    from tokenwire.kernels.rotary_triton import apply_rotary_triton
    from tokenwire.kernels.store_kv_triton import store_kv_triton

    bf16 = torch.bfloat16
    slots = torch.arange(4)
    for dtype in (bf16, torch.float32):
        x = torch.empty(4, 4096, dtype=dtype)
        rms_norm_triton(x, x[0], 1e-5)
        fused_add_rms_norm_triton(x, x, x[0], 1e-5)
        silu_and_mul_triton(torch.empty(4, 2 * 14336, dtype=dtype))
        gelu_tanh_and_mul_triton(torch.empty(4, 2 * 9216, dtype=dtype))  # Gemma-2-2B
        k = torch.empty(4, 8, 128, dtype=dtype)
        store_kv_triton(k, k, torch.empty(4, 16, 8, 128, dtype=dtype), torch.empty_like(k), slots)
        apply_rotary_triton(torch.empty(4, 32, 128, dtype=dtype), k, slots, torch.empty(9, 128))
    k = torch.empty(4, 8, 128, dtype=bf16)
    fp8_cache = torch.empty(4, 16, 8, 128, dtype=torch.float8_e4m3fn)
    store_kv_triton(k, k, fp8_cache, fp8_cache, slots, torch.ones(1), torch.ones(1))
    k256 = torch.empty(4, 4, 256, dtype=bf16)  # Gemma 2: head_dim 256
    apply_rotary_triton(torch.empty(4, 8, 256, dtype=bf16), k256, slots, torch.empty(9, 256))


def _moe_launches() -> None:
    """Mixtral-8x7B (8 experts, top 2), Qwen3-30B-A3B (128 experts, top 8), Llama 4 Scout
    (16 experts, top 1, input-scaled) and gpt-oss-20b (32 experts, top 4, biases and
    ``swigluoai``; the down bias absent too, as on tensor-parallel ranks > 0) at decode and
    prefill sizes (each tile choice of ``default_tiles``), and float32 tiny ones."""
    from tokenwire.kernels.moe_triton import fused_moe_triton

    bf16, f32 = torch.bfloat16, torch.float32
    oai = {"activation": "swigluoai", "swiglu": (1.702, 7.0)}
    shapes: list[tuple[int, int, int, int, torch.dtype, dict[str, Any]]] = [
        (4096, 14336, 8, 2, bf16, {}),
        (2048, 768, 128, 8, bf16, {}),
        (5120, 8192, 16, 1, bf16, {"scale_input": True}),
        (2880, 2880, 32, 4, bf16, {**oai, "biases": "gate_up+down"}),  # gpt-oss-20b
        (2880, 2880, 32, 4, bf16, {**oai, "biases": "gate_up"}),
        (64, 96, 4, 2, f32, {}),
        (64, 128, 4, 2, f32, {**oai, "biases": "gate_up+down"}),  # the smoke's tiny gpt-oss
    ]
    for hidden, inter, experts, top_k, dtype, extra in shapes:
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=dtype)  # untouched: no memory
        w2 = torch.empty(experts, hidden, inter, dtype=dtype)
        if "biases" in extra:
            down = torch.empty(experts, hidden, dtype=dtype)
            biases = (w13[:, :, 0].contiguous(), down if "down" in extra["biases"] else None)
            extra = {**extra, "biases": biases}
        for tokens in (1, 16 * experts, 512 * experts // top_k):
            ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
            weights = torch.full((tokens, top_k), 1.0 / top_k)
            x = torch.empty(tokens, hidden, dtype=dtype)
            fused_moe_triton(x, w13, w2, weights, ids, **extra)


def _moe_mxfp4_launches() -> None:
    """gpt-oss-20b's experts kept in MXFP4 (2880 hidden and intermediate, 32 experts, top 4,
    bf16, biases with and without the down bias, the checkpoint's interleaved gate/up rows) at
    decode and prefill sizes, and a float32 tiny one."""
    from tokenwire.kernels.moe_mxfp4_triton import fused_moe_mxfp4_triton

    bf16, f32, u8 = torch.bfloat16, torch.float32, torch.uint8
    for hidden, inter, experts, top_k, dtype, down_bias in (
        (2880, 2880, 32, 4, bf16, True),
        (2880, 2880, 32, 4, bf16, False),
        (64, 128, 4, 2, f32, True),
    ):
        w13 = (torch.empty(experts, 2 * inter, hidden // 32, 16, dtype=u8),
               torch.empty(experts, 2 * inter, hidden // 32, dtype=u8))  # fmt: skip
        w2 = (torch.empty(experts, hidden, inter // 32, 16, dtype=u8),
              torch.empty(experts, hidden, inter // 32, dtype=u8))  # fmt: skip
        down = torch.empty(experts, hidden, dtype=dtype) if down_bias else None
        biases = (torch.empty(experts, 2 * inter, dtype=dtype), down)
        for tokens in (1, 16 * experts, 512 * experts // top_k):
            ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
            weights = torch.full((tokens, top_k), 1.0 / top_k)
            x = torch.empty(tokens, hidden, dtype=dtype)
            fused_moe_mxfp4_triton(
                x, w13, w2, weights, ids, "swigluoai", biases=biases, swiglu=(1.702, 7.0),
                interleaved=True,
            )  # fmt: skip


def compile_launch(launch: Launch, target: GPUTarget) -> None:
    fn, args, kwargs = launch
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    defaults = {name: p.default for name, p in fn.signature.parameters.items()}
    values = defaults | dict(zip(fn.arg_names, args, strict=False)) | kwargs
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for param, name in zip(fn.params, fn.arg_names, strict=True):
        value = values[name]
        if param.is_constexpr or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _PTR_TYPES[value.dtype]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options)
    shared = kernel.metadata.shared
    if shared > SM90_MAX_SHARED:
        raise RuntimeError(f"needs {shared} bytes of shared memory, sm_90 has {SM90_MAX_SHARED}")


# Modules whose every ``*_kernel`` must be among the launches above (LoRA and the quantized
# matmuls have their own compile checks in their test modules).
COVERED_MODULES = (
    "activation_triton",
    "mla_decode_triton",
    "moe_mxfp4_triton",
    "moe_triton",
    "paged_attention_triton_decode",
    "paged_attention_triton_prefill",
    "rmsnorm_triton",
    "rotary_triton",
    "store_kv_triton",
)


def uncovered_kernels(launches: list[Launch]) -> list[str]:
    """Kernels of ``COVERED_MODULES`` that no captured launch compiles (a new kernel or
    variant must be added to ``capture_launches``)."""
    import importlib

    launched = {fn.fn for fn, _, _ in launches}
    missing = []
    for module_name in COVERED_MODULES:
        module = importlib.import_module(f"tokenwire.kernels.{module_name}")
        for name, value in vars(module).items():
            is_kernel = isinstance(value, JITFunction) and name.endswith("_kernel")
            if is_kernel and value.fn not in launched:
                missing.append(f"{module_name}.{name}")
    return missing


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    launches = capture_launches()
    for name in uncovered_kernels(launches):
        failed += 1
        print(f"{name}: never launched by capture_launches", file=sys.stderr)
    for launch in launches:
        try:
            compile_launch(launch, target)
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            print(f"{launch[0].__name__}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
