"""``LoRAManager``: one worker's adapters — a CPU cache and ``max_loras`` device slots.

Built by the model runner when LoRA is enabled: it swaps the decoder's four linear layers
(``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) for their ``*WithLoRA`` wrappers.
Before each step the runner hands it the adapters of the step's rows (``activate``): an
adapter not yet in CPU memory is read from its ``lora_path`` (LRU over ``max_cpu_loras``), one
not in a device slot is copied into a free or least recently used slot whose adapter this step
does not use (the scheduler never puts more than ``max_loras`` adapters in one step). Then
``set_tokens`` publishes the step's token runs per slot to every layer.

Decode CUDA graphs (``worker.cuda_graphs``) capture the LoRA path once per bucket over the
persistent ``SegmentBuffers`` (``graph_rows``, after ``clear_runs``) and replay it with
whatever runs the buffers hold: so ``set_tokens`` writes every step's runs there, and a step
without adapter tokens clears the runs a previous step left (eager steps skip LoRA then).

Every tensor-parallel rank runs the same manager on the same ``SchedulerOutput``s, so all
make the same choices; each copies only its own shard of each adapter into its slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from tokenwire.kernels.lora import SegmentBuffers
from tokenwire.runtime.config import LoRAConfig
from tokenwire.runtime.lora.adapter import AdapterWeights, inspect_adapter, load_adapter
from tokenwire.runtime.lora.layers import (
    ColumnLinearWithLoRA,
    LoRAContext,
    ProjectionLoRA,
    RowLinearWithLoRA,
)
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.models.llama import DecoderLayer, LlamaForCausalLM
from tokenwire.runtime.models.mla import MLAttention
from tokenwire.runtime.models.moe import SparseMoeBlock

LoRALayer = ColumnLinearWithLoRA | RowLinearWithLoRA
MASKED_MAX_TOKENS = 256  # CPU steps up to this many tokens take the masked all-slots path


def wrap_model(
    model: LlamaForCausalLM, config: LoRAConfig, context: LoRAContext, dtype: torch.dtype
) -> list[list[LoRALayer]]:
    """Swap every decoder layer's linears for LoRA wrappers; returns them per layer."""
    arch, n, r = model.arch, config.max_loras, config.max_lora_rank
    wrapped: list[list[LoRALayer]] = []
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(attn, MLAttention):
            raise ValueError(f"--enable-lora is not supported for MLA models ({arch.architecture})")
        if isinstance(mlp, SparseMoeBlock):
            raise ValueError(
                "--enable-lora is not supported for mixture-of-experts models "
                f"({arch.architecture})"
            )
        qkv = ColumnLinearWithLoRA(
            attn.qkv_proj, ("q_proj", "k_proj", "v_proj"), arch.hidden_size, n, r, context, dtype
        )
        gate_up = ColumnLinearWithLoRA(
            mlp.gate_up_proj, ("gate_proj", "up_proj"), arch.hidden_size, n, r, context, dtype
        )
        o_proj = RowLinearWithLoRA(attn.o_proj, "o_proj", n, r, context, dtype)
        down = RowLinearWithLoRA(mlp.down_proj, "down_proj", n, r, context, dtype)
        for owner, name, wrapper in (
            (attn, "qkv_proj", qkv),
            (attn, "o_proj", o_proj),
            (mlp, "gate_up_proj", gate_up),
            (mlp, "down_proj", down),
        ):
            setattr(owner, name, wrapper)  # the wrapper calls the base layer it replaces
        wrapped.append([qkv, o_proj, gate_up, down])
    return wrapped


class LoRAManager:
    def __init__(
        self, model: LlamaForCausalLM, config: LoRAConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.config = config
        self.arch = model.arch
        self.context = LoRAContext(config.max_loras)
        self._masked = device.type == "cpu"  # the masked all-slots path (see LoRAContext)
        self.layers = wrap_model(model, config, self.context, dtype)
        self._cpu: OrderedDict[int, AdapterWeights] = OrderedDict()  # LRU: oldest first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # resident id -> slot, LRU
        self._free_slots = list(range(config.max_loras))
        # Each adapter's rows form at most two runs (decode rows, then prefill rows).
        self._buffers = SegmentBuffers(2 * config.max_loras, device)
        self._runs_on_device = False  # whether the buffers may hold a previous step's runs

    @property
    def resident(self) -> dict[int, int]:
        """Adapter id -> device slot, for the adapters now on the device."""
        return dict(self._slot_of)

    @property
    def cached(self) -> list[int]:
        """Adapter ids held in CPU memory, least recently used first."""
        return list(self._cpu)

    def activate(self, requests: list[LoRARequest]) -> dict[int, int]:
        """Make the step's adapters resident; returns adapter id -> slot."""
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(
                f"{len(wanted)} adapters in one step, more than --max-loras "
                f"({self.config.max_loras}): the scheduler must not allow this"
            )
        for lora_id, request in wanted.items():
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                continue
            weights = self._cpu_weights(request)
            slot = self._take_slot(keep=wanted.keys())
            self._load_slot(slot, weights)
            self._slot_of[lora_id] = slot
        return {lora_id: self._slot_of[lora_id] for lora_id in wanted}

    def prepare_step(
        self, loras: list[LoRARequest | None], query_lens: np.ndarray, num_decodes: int
    ) -> np.ndarray | None:
        """Set up a step whose rows run ``loras`` (None: the base). Returns the row order
        that keeps decode rows first and puts each adapter's rows together (None: keep
        the order), so each adapter's tokens form at most two runs."""
        ids = np.fromiter((0 if r is None else r.lora_int_id for r in loras), np.int64, len(loras))
        if not ids.any():
            self.set_tokens(None)
            return None
        order = np.concatenate(
            [
                np.argsort(ids[:num_decodes], kind="stable"),
                num_decodes + np.argsort(ids[num_decodes:], kind="stable"),
            ]
        )
        slot_of = self.activate([r for r in loras if r is not None])
        row_slots = np.fromiter((slot_of.get(int(i), -1) for i in ids[order]), np.int64, len(ids))
        self.set_tokens(np.repeat(row_slots, query_lens[order]))
        return order

    def set_tokens(self, token_slots: np.ndarray | None) -> None:
        """This step's adapter slot per token (-1: none); None: no token uses one."""
        if token_slots is None or not (token_slots >= 0).any():
            self.context.set(None, None)
            if self._runs_on_device:  # a decode graph reads the buffers, not the context
                self._buffers.clear()
                self._runs_on_device = False
            return
        segments = self._buffers.fill(token_slots)
        self._runs_on_device = True
        slots = None
        # Masked: 2 matmuls per layer but S-fold rank columns for every token, which pays
        # on decode-sized steps (dispatch-bound) and not on long prefill chunks (flop-bound).
        if self._masked and len(segments.runs) > 1 and len(token_slots) <= MASKED_MAX_TOKENS:
            slots = torch.from_numpy(np.ascontiguousarray(token_slots, dtype=np.int64))
        self.context.set(segments, slots)

    # ------------------------------------------------------------------ decode graphs
    def clear_runs(self) -> None:
        """Leave no run in the device buffers (before a graph capture: its warm-up and
        capture then add no LoRA delta)."""
        self._buffers.clear()
        self._runs_on_device = False

    def graphable(self, num_tokens: int) -> bool:
        """Whether a decode graph over ``num_tokens`` rows replays this step's LoRA exactly:
        its runs (if any) are in the persistent buffers for those rows, and the step does
        not take the masked CPU path."""
        context = self.context
        if context.token_slots is not None:
            return False
        segments = context.segments
        if segments is None:  # set_tokens cleared the buffers
            return True
        return segments.lengths is self._buffers.lengths and segments.num_tokens == num_tokens

    @contextmanager
    def graph_rows(self, num_tokens: int) -> Iterator[None]:
        """Within: every LoRA layer takes the segmented path over the persistent buffers for
        ``num_tokens`` rows (what a decode graph of that bucket captures: whatever runs the
        buffers hold when it replays). The step's own context is restored after."""
        context = self.context
        saved = (context.segments, context.token_slots)
        context.set(self._buffers.segments(num_tokens), None)
        try:
            yield
        finally:
            context.set(*saved)

    def remove(self, lora_ids: frozenset[int]) -> None:
        """Forget unloaded adapters (their requests have all finished)."""
        for lora_id in lora_ids:
            self._cpu.pop(lora_id, None)
            slot = self._slot_of.pop(lora_id, None)
            if slot is not None:
                self._free_slots.append(slot)

    # ------------------------------------------------------------------ internals
    def _cpu_weights(self, request: LoRARequest) -> AdapterWeights:
        weights = self._cpu.get(request.lora_int_id)
        if weights is not None:
            self._cpu.move_to_end(request.lora_int_id)
            return weights
        spec = inspect_adapter(request.lora_path, self.arch, self.config.max_lora_rank)
        weights = load_adapter(spec)
        self._cpu[request.lora_int_id] = weights
        while len(self._cpu) > self.config.cpu_capacity:
            self._cpu.popitem(last=False)
        return weights

    def _take_slot(self, keep: object) -> int:
        if self._free_slots:
            return self._free_slots.pop(0)
        for lora_id in self._slot_of:  # least recently used first
            if lora_id not in keep:  # type: ignore[operator]
                return self._slot_of.pop(lora_id)
        raise RuntimeError("no LoRA slot is free")

    def _load_slot(self, slot: int, weights: AdapterWeights) -> None:
        for index, layers in enumerate(self.layers):
            per_module: dict[str, ProjectionLoRA] = {
                module: ab for (layer, module), ab in weights.weights.items() if layer == index
            }
            for layer in layers:
                layer.set_slot(slot, per_module)
