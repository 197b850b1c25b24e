"""The workers' side of ``draft_model`` speculation: a small model with its own paged KV cache.

The draft's cache has the target's block count and block size and is addressed through the
target's block tables and slot mappings, so it needs no block manager of its own: position
``p`` of a request lives in the same slot of both caches.

For a decoding request whose last known token sits at position ``p`` (not yet in either
cache) and that the scheduler gave ``k`` draft slots, inside the step that verifies them:

1. one draft forward over positions ``computed .. p`` — the catch-up of what the target
   computed without the draft (the whole prefix the first time) — gives ``d_1`` greedily;
2. ``k - 1`` one-token forwards at ``p + 1 .. p + k - 1`` give ``d_2 .. d_k``.

The draft cache then holds positions up to ``p + k - 1``; after verification the valid prefix
is ``min(p + k, the target's computed count)`` (rejected drafts' slots are rewritten later).
A new or resumed request starts at ``computed = 0``: blocks it shares through the prefix cache
may have been filled by requests that never drafted, so their draft slots hold nothing valid
(rewriting them is harmless: the same tokens give the same draft KV).

Greedy drafts are a deterministic proposal, so ``verify`` accepts them exactly as it accepts
n-gram drafts: the output distribution is the target's. Under tensor parallelism every rank
runs the same forwards (the draft is sharded like the target) and the all-gathered logits are
bitwise identical on every rank, so every rank proposes the same drafts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from tokenwire.runtime.config import CacheConfig, ModelConfig, SpeculativeConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.worker.attention_inputs import AttentionInputs
from tokenwire.runtime.worker.input_batch import InputBatch
from tokenwire.runtime.worker.kv_cache import KVCache, bytes_per_block, kv_cache_torch_dtype
from tokenwire.runtime.worker.request_state import CachedRequestState


class DraftModel:
    """``inputs`` builds the draft's step inputs (its own sliding windows); ``propose`` and
    ``settle`` read and write the target's ``InputBatch`` rows they are given."""

    def __init__(self, loaded: LoadedModel, kv_cache: KVCache, inputs: AttentionInputs) -> None:
        self.model = loaded.model
        self.arch = loaded.arch
        self.kv_cache = kv_cache
        self.inputs = inputs
        # Request id -> leading positions whose draft KV is valid.
        self.computed: dict[str, int] = {}

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: its draft KV is gone with its blocks."""
        self.computed.pop(request_id, None)

    def propose(
        self,
        batch: InputBatch,
        states: list[CachedRequestState],
        slots: dict[str, list[int]],
    ) -> dict[str, list[int]]:
        """Greedy drafts for every request with draft ``slots`` (as many as it has slots)."""
        chosen = [s for s in states if slots.get(s.request_id) and s.row is not None]
        if not chosen:
            return {}
        rows = np.array([s.row for s in chosen], dtype=np.int64)
        last = batch.num_computed[rows].astype(np.int64)  # position of the last known token
        k = np.array([len(slots[s.request_id]) for s in chosen], dtype=np.int64)
        start = np.array(
            [
                min(self.computed.get(s.request_id, 0), int(p))
                for s, p in zip(chosen, last, strict=True)
            ],
            dtype=np.int64,
        )
        drafts = np.zeros((len(chosen), int(k.max())), dtype=np.int64)
        order = np.argsort(last > start, kind="stable")  # one-token rows first (decodes)
        drafts[order, 0] = self._forward(batch, rows[order], start[order], last[order])
        for i in range(1, int(k.max())):
            live = np.flatnonzero(k > i)
            batch.token_ids[rows[live], last[live] + i] = drafts[live, i - 1]
            drafts[live, i] = self._forward(batch, rows[live], last[live] + i, last[live] + i)
        for j, state in enumerate(chosen):
            self.computed[state.request_id] = int(last[j] + k[j])
        return {s.request_id: drafts[j, : k[j]].tolist() for j, s in enumerate(chosen)}

    def settle(self, batch: InputBatch, states: list[CachedRequestState]) -> None:
        """After verification: keep only the draft KV of positions the target accepted."""
        for state in states:
            count = self.computed.get(state.request_id)
            if count is not None and state.row is not None:
                valid = int(batch.num_computed[state.row])
                self.computed[state.request_id] = min(count, valid)

    @torch.inference_mode()
    def _forward(
        self, batch: InputBatch, rows: np.ndarray, first: np.ndarray, last: np.ndarray
    ) -> np.ndarray:
        """One draft forward over positions ``first[i] .. last[i]`` of each row (rows with a
        single position must come first); the greedy next token after each row's last."""
        query_lens = last - first + 1
        saved = batch.num_computed[rows].copy()
        batch.num_computed[rows] = first
        try:
            arrays = batch.build(rows, query_lens, int(np.count_nonzero(query_lens == 1)))
        finally:
            batch.num_computed[rows] = saved
        inputs = self.inputs
        meta = inputs.metadata(arrays)
        hidden = self.model(
            inputs.to_device(arrays.input_ids),
            inputs.to_device(arrays.positions),
            self.kv_cache.layers,
            meta,
        )
        ends = inputs.to_device(arrays.query_start_loc[1:].astype(np.int64) - 1)
        logits = self.model.compute_logits(hidden[ends])
        result: np.ndarray = logits.argmax(dim=-1).cpu().numpy()
        return result


def draft_bytes_per_block(draft: LoadedModel, cache_config: CacheConfig, tp_size: int) -> int:
    """The draft cache's bytes per block on one rank (it shares the target's KV budget)."""
    kv_dtype = kv_cache_torch_dtype(cache_config.kv_cache_dtype, draft.dtype)
    return bytes_per_block(draft.arch, cache_config.block_size, kv_dtype, tp_size)


def load_draft_model(
    target_config: ModelConfig,
    spec: SpeculativeConfig,
    target: LoadedModel,
    tp: TPGroup,
) -> LoadedModel:
    """The draft of ``spec`` on the target's device and dtype, loaded like the target (same
    load format and hub settings); checked against the target at startup: the same
    vocabulary, and room for the target's whole context."""
    assert spec.model is not None
    config = dataclasses.replace(
        target_config,
        model=spec.model,
        tokenizer=None,
        served_model_name=None,
        quantization=None,
        revision=None,
        chat_template=None,
        generation_config="vllm",
        max_model_len=None,
    )
    draft = _load(config, spec.model, target, tp)
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ValueError(
            f"--speculative-config model {spec.model!r} has vocab_size "
            f"{draft.arch.vocab_size}, the target {target.arch.vocab_size}: the draft must "
            "use the target's tokenizer"
        )
    if same_vocabulary(draft.tokenizer_dir, target.tokenizer_dir) is False:
        raise ValueError(
            f"--speculative-config model {spec.model!r} has a different tokenizer vocabulary "
            "than the target: the draft must use the target's tokenizer"
        )
    if draft.max_model_len < target.max_model_len:
        raise ValueError(
            f"--speculative-config model {spec.model!r} has a context of {draft.max_model_len} "
            f"tokens, fewer than the target's max_model_len {target.max_model_len}: lower "
            "--max-model-len"
        )
    return draft


def _load(config: ModelConfig, name: str, target: LoadedModel, tp: TPGroup) -> LoadedModel:
    """Load the draft; any failure is a startup error naming ``--speculative-config`` (the
    loader's own messages name ``--model``'s argument, ``model: ...``)."""
    try:
        return load_model(config, target.device, target.dtype, tp)
    except (OSError, ValueError) as exc:
        reason = str(exc).removeprefix("model: ")
    except Exception as exc:  # an unreadable checkpoint: safetensors', torch's own errors
        reason = f"cannot read its weights ({type(exc).__name__}: {exc})"
    reason = " ".join(reason.split())  # one line
    raise ValueError(f"--speculative-config model {name!r}: {reason}")


def same_vocabulary(a: Path | None, b: Path | None) -> bool | None:
    """Whether two tokenizer folders map the same strings to the same ids (their
    ``tokenizer.json`` vocabularies and added tokens); None when either has no such file."""
    files = [None if d is None else Path(d) / "tokenizer.json" for d in (a, b)]
    if any(f is None or not f.is_file() for f in files):
        return None
    vocabs = []
    for f in files:
        assert f is not None
        data = json.loads(f.read_text())
        added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
        vocabs.append((data.get("model", {}).get("vocab"), added))
    return vocabs[0] == vocabs[1]
