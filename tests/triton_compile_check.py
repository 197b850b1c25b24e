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

_PTR_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}
Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]


def capture_launches() -> list[Launch]:
    """Run each wrapper once on CPU tensors; record ``(kernel, args, kwargs)`` per launch."""
    from tokenwire.kernels.activation_triton import silu_and_mul_triton
    from tokenwire.kernels.attention_metadata import AttentionMetadata
    from tokenwire.kernels.paged_attention_triton import paged_attention_triton
    from tokenwire.kernels.rmsnorm_triton import fused_add_rms_norm_triton, rms_norm_triton
    from tokenwire.kernels.rotary_triton import apply_rotary_triton
    from tokenwire.kernels.store_kv_triton import store_kv_triton

    launches: list[Launch] = []
    JITFunction.__getitem__ = lambda self, grid: (  # type: ignore[method-assign]
        lambda *args, **kwargs: launches.append((self, args, kwargs))
    )
    bf16 = torch.bfloat16
    qsl = torch.tensor([0, 1, 2, 12], dtype=torch.int32)
    meta = AttentionMetadata(
        num_tokens=12, num_seqs=3, num_decodes=2, block_size=16,
        slot_mapping=torch.arange(12), query_start_loc=qsl,
        seq_lens=torch.tensor([5, 40, 30], dtype=torch.int32),
        block_tables=torch.ones(3, 4, dtype=torch.int32), max_query_len=10, max_seq_len=40,
        query_start_loc_np=qsl.numpy(), seq_lens_np=qsl.numpy(),
    )  # fmt: skip
    for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
        cache = torch.empty(8, 16, hkv, d, dtype=bf16)
        paged_attention_triton(torch.empty(12, hq, d, dtype=bf16), cache, cache, meta, 0.1)
    x = torch.empty(4, 4096, dtype=bf16)
    rms_norm_triton(x, x[0], 1e-5)
    fused_add_rms_norm_triton(x, x, x[0], 1e-5)
    silu_and_mul_triton(torch.empty(4, 2 * 14336, dtype=bf16))
    k = torch.empty(4, 8, 128, dtype=bf16)
    store_kv_triton(k, k, torch.empty(4, 16, 8, 128, dtype=bf16), torch.empty_like(k), qsl)
    apply_rotary_triton(torch.empty(4, 32, 128, dtype=bf16), k, qsl, torch.empty(9, 128))
    return launches


def compile_launch(launch: Launch, target: GPUTarget) -> None:
    fn, args, kwargs = launch
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    values = dict(zip(fn.arg_names, args, strict=False)) | kwargs
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
    triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options)


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for launch in capture_launches():
        try:
            compile_launch(launch, target)
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            print(f"{launch[0].__name__}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
