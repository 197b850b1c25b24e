"""Pooling of embedding requests' hidden states, across chunked-prefill steps.

An embedding request's prompt may run over several steps (chunked prefill). ``MEAN`` keeps a
float32 running sum of its hidden states (exact across chunks: the same sum, split), ``CLS``
keeps the first position's state, ``LAST`` needs only the final chunk. When a request's last
chunk ran, ``step`` returns its vector: pooled, cut to ``dimensions`` (Matryoshka) and
L2-normalized when the pooler normalizes. Embedding requests never take a prefix hit (the
scheduler computes every prompt position), so position 0 is always in the first chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from tokenwire.runtime.pooling_params import PoolingParams, ResolvedPooler
from tokenwire.runtime.worker.input_batch import StepArrays
from tokenwire.runtime.worker.request_state import CachedRequestState


def finish_vector(
    vector: torch.Tensor, pooler: ResolvedPooler, params: PoolingParams
) -> list[float]:
    """Matryoshka cut, then normalization, as plain floats (float32 precision)."""
    vector = vector.float()
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if pooler.normalize:
        vector = F.normalize(vector, p=2.0, dim=-1)
    out: list[float] = vector.cpu().tolist()
    return out


class Pooler:
    def __init__(self, pooler: ResolvedPooler) -> None:
        self.config = pooler
        self._partial: dict[str, torch.Tensor] = {}  # MEAN: running sums; CLS: first state

    def forget(self, request_id: str) -> None:
        """Drop a finished or preempted request's partial state (a preempted one restarts)."""
        self._partial.pop(request_id, None)

    def step(
        self,
        request_ids: Sequence[str],
        params: Sequence[PoolingParams],
        starts: np.ndarray,
        ends: np.ndarray,
        done: np.ndarray,
        num_prompt: np.ndarray,
        hidden: torch.Tensor,
    ) -> dict[str, list[float]]:
        """``request_ids[i]``'s tokens this step are ``hidden[starts[i]:ends[i]]``; ``done[i]``:
        its prompt completed. Returns the finished requests' vectors."""
        kind = self.config.pooling_type
        pooled: dict[str, list[float]] = {}
        for i, request_id in enumerate(request_ids):
            rows = hidden[int(starts[i]) : int(ends[i])]
            if kind == "MEAN":
                total = rows.float().sum(dim=0)
                previous = self._partial.get(request_id)
                total = total if previous is None else previous + total
                if not done[i]:
                    self._partial[request_id] = total
                    continue
                vector = total / float(num_prompt[i])
            elif kind == "CLS":
                first = self._partial.setdefault(request_id, rows[0].float())
                if not done[i]:
                    continue
                vector = first
            else:
                if not done[i]:
                    continue
                vector = rows[-1]
            self._partial.pop(request_id, None)
            pooled[request_id] = finish_vector(vector, self.config, params[i])
        return pooled


def pool_rows(
    pooler: Pooler,
    states: Sequence[CachedRequestState],
    arrays: StepArrays,
    hidden: torch.Tensor,
    samples: np.ndarray,
) -> tuple[dict[str, list[float]], np.ndarray]:
    """Pool this step's embedding rows (``samples[i]``: row ``i``'s prompt completed); returns
    their finished vectors and ``samples`` without them (embedding rows never sample)."""
    is_pool = np.fromiter(
        (s.params.pooling is not None for s in states), dtype=bool, count=len(states)
    )
    if not is_pool.any():
        return {}, samples
    idx = np.flatnonzero(is_pool)
    chosen = [states[int(i)] for i in idx]
    qsl = arrays.query_start_loc
    pooled = pooler.step(
        [s.request_id for s in chosen],
        [s.params.pooling or PoolingParams() for s in chosen],
        qsl[idx],
        qsl[idx + 1],
        samples[idx],
        np.array([len(s.prompt_token_ids) for s in chosen], dtype=np.int64),
        hidden,
    )
    return pooled, samples & ~is_pool
