"""A compiled CPU forward (``--cpu-compile``): the model as one inductor graph per step.

Eager, a CPU decode step of a small model is hundreds of small ops (norms, rotary, views,
residual adds, casts around the int4 linears), each paying the dispatcher; inductor fuses
them into a few C++ loops. The paged attention stays eager: every layer calls it through one
opaque custom op, ``(q, k, v, layer) -> out``, that stores K/V and attends with the step's
metadata held here, so the graph sees neither the cache tensors nor the Python plans (and
dynamo never specialises on them). The op is registered in a namespace of this instance's
own (``torch.library.Library``, ``_own_library``), dropped with it: no process-wide registry
of ours.

Two graphs serve every step size: ``dynamic=True`` over the row count, which dynamo
specialises for a single row (one-stream decode) and keeps symbolic above. A row's arithmetic
does not depend on which graph or how many rows the step has: the fused loops run per row
and the int4 linears are torch's own kernel (tested: a prompt alone gives the tokens it gives
inside a batch of 16; padding one-row steps to two rows instead cost 1.9 ms of a 15 ms
forward, measured). The graph is compiled at startup by a warm-up step
(``warm_up``, its cost logged); a compile or run that raises falls back to the eager forward
for good, with one log line, never a crash.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.runtime.models.decoder import Attention, DecoderLayer, KVCache
from tokenwire.runtime.models.llama import LlamaForCausalLM
from tokenwire.runtime.models.llava import LlavaForConditionalGeneration
from tokenwire.runtime.worker.attention_inputs import AttentionInputs
from tokenwire.runtime.worker.input_batch import StepArrays

logger = logging.getLogger("tokenwire.worker")

Backend = str | Callable[..., Any]


def cpu_compile_blocker(model: torch.nn.Module, device: torch.device, lora: bool) -> str | None:
    """Why ``--cpu-compile`` cannot apply to this model (None: it can)."""
    if device.type != "cpu":
        return "the device is not the CPU (CUDA steps replay CUDA graphs)"
    if isinstance(model, LlavaForConditionalGeneration):
        return "image embeddings are placed eagerly (a vision-language model)"
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} has no compiled forward"
    if model.tp.world_size > 1:
        return "tensor parallel steps run eagerly"
    if lora:
        return "LoRA steps run eagerly"
    if model.arch.mla is not None:
        return "MLA attention (DeepSeek) runs eagerly"
    if any(model.arch.layer_is_sparse(i) for i in range(model.arch.num_hidden_layers)):
        return "MoE layers route data-dependently and run eagerly"
    return None


class CompiledCpuForward:
    """``model``'s forward compiled once for every step size, attention kept eager."""

    def __init__(
        self, model: LlamaForCausalLM, kv_layers: list[KVCache], backend: Backend = "inductor"
    ) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self._meta: AttentionMetadata | None = None
        self.failed = False
        self.namespace, lib = _own_library()
        lib.define("attn(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")  # type: ignore[no-untyped-call]
        lib.impl("attn", self._attention, "CPU")  # type: ignore[no-untyped-call]
        torch.library.register_fake(f"{self.namespace}::attn", _fake_attention, lib=lib)
        self._lib = lib  # the op lives as long as this object
        op = getattr(torch.ops, self.namespace).attn
        # MLA layers never get here (``cpu_compile_blocker``).
        self.attentions = [
            cast(Attention, cast(DecoderLayer, layer).self_attn) for layer in model.model.layers
        ]
        for attention in self.attentions:
            attention.external_attention = op
        self._no_caches: list[KVCache | None] = [None] * len(kv_layers)
        self._compiled = torch.compile(model.forward, dynamic=True, backend=backend)

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """The op's CPU kernel: the layer's eager attention with the step's metadata."""
        meta = self._meta
        if meta is None:
            raise RuntimeError("compiled attention called outside a step")
        out: torch.Tensor = self.attentions[layer].attend(q, k, v, self.kv_layers[layer], meta)
        return out

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; eager once the compiled graph has failed."""
        if self.failed:
            return self._eager(input_ids, positions, meta)
        self._meta = meta
        try:
            hidden: torch.Tensor = self._compiled(input_ids, positions, self._no_caches, None)
        except Exception as exc:
            logger.warning("cpu compile failed, running eagerly from now on: %r", exc)
            self.failed = True
            return self._eager(input_ids, positions, meta)
        finally:
            self._meta = None
        return hidden

    def _eager(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.model(input_ids, positions, self.kv_layers, meta)
        return hidden

    def warm_up(self, inputs: AttentionInputs) -> float:
        """Compile with a two-row step that writes no KV (slot -1); seconds taken."""
        start = time.perf_counter()
        arrays = StepArrays(
            input_ids=np.zeros(2, dtype=np.int64),
            positions=np.zeros(2, dtype=np.int64),
            slot_mapping=np.full(2, -1, dtype=np.int64),
            query_start_loc=np.arange(3, dtype=np.int32),
            seq_lens=np.ones(2, dtype=np.int32),
            block_tables=np.zeros((2, 1), dtype=np.int32),
            num_decodes=2,
            max_query_len=1,
            max_seq_len=1,
        )
        with torch.inference_mode():
            self.forward(
                inputs.to_device(arrays.input_ids),
                inputs.to_device(arrays.positions),
                inputs.metadata(arrays),
            )
        seconds = time.perf_counter() - start
        if self.failed:
            logger.warning("cpu compile: warm-up failed after %.1f s; steps run eagerly", seconds)
        else:
            logger.info("cpu compile: forward compiled in %.1f s", seconds)
        return seconds


def _own_library() -> tuple[str, torch.library.Library]:
    """The lowest free ``tokenwire_cpu_<n>`` namespace, claimed: torch allows one defining
    library per namespace, so a live compiled forward's name is never reused, and the first
    one of a process is always ``tokenwire_cpu_0`` (the graph, hence inductor's on-disk cache
    key, is the same in every process: a restart reuses the compiled code)."""
    for n in itertools.count():
        namespace = f"tokenwire_cpu_{n}"
        try:
            return namespace, torch.library.Library(namespace, "DEF")  # type: ignore[no-untyped-call]
        except RuntimeError:
            continue
    raise AssertionError("unreachable")


def compile_cpu_forward(
    model: torch.nn.Module,
    kv_layers: list[KVCache],
    inputs: AttentionInputs,
    device: torch.device,
    lora: bool,
) -> CompiledCpuForward | None:
    """``--cpu-compile``: the compiled forward, warmed up; None (logged) where it cannot
    apply."""
    blocker = cpu_compile_blocker(model, device, lora)
    if blocker is not None or not isinstance(model, LlamaForCausalLM):
        logger.info("--cpu-compile not applied: %s", blocker)
        return None
    compiled = CompiledCpuForward(model, kv_layers)
    compiled.warm_up(inputs)
    return compiled


def _fake_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)
