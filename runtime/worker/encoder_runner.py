"""``EncoderRunner``: the executor side of a BERT-family encoder (bidirectional attention).

Encoder requests go through the same scheduler as every other request (admission limits,
tenants, priorities, metrics), as prefill-only requests that are never chunked
(``Scheduler(encoder_only=True)``): each scheduled prompt runs whole in one step, is pooled
and finishes in that step's update. The scheduler's KV blocks are bookkeeping only here (no
KV tensors exist; ``num_blocks`` covers ``max_num_seqs`` full-length sequences, so an
encoder step never preempts); they are freed when the request finishes.

One step = one padded batch through ``BertModel``, then per-row pooling (``CLS``, ``MEAN``
over the real tokens, or ``LAST``), Matryoshka cut and normalization (``pooler``). A
cross-encoder (``BertForSequenceClassification``) runs its text pairs with token type 1 from
each request's ``pair_start`` and returns its activated logits as the row's "vector" (one
float: the score).
"""

from __future__ import annotations

import time

import torch

from tokenwire.runtime.loader.encoder_loader import LoadedEncoder
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.models.bert_classifier import BertForSequenceClassification
from tokenwire.runtime.pooling_params import PoolingParams
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.worker.pooler import finish_vector
from tokenwire.runtime.worker.runner_settings import RunnerSettings


class EncoderRunner:
    def __init__(
        self, loaded: LoadedEncoder, settings: RunnerSettings, device: torch.device
    ) -> None:
        self.model = loaded.model
        self.pooler = loaded.embed.pooler
        self.device = device
        self.pad_token_id = loaded.shape.pad_token_id
        per_seq = -(-loaded.max_model_len // settings.cache.block_size)
        self._num_blocks: int = 1 + settings.max_num_seqs * per_seq  # block 0 is the null block
        # request_id -> (prompt, pooling params) between admission and its (same-step) pool.
        self._pending: dict[str, tuple[list[int], PoolingParams]] = {}

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelOutput:
        t0 = time.perf_counter()
        for request_id in so.finished_req_ids:
            self._pending.pop(request_id, None)
        for new in so.new_reqs:
            pooling = new.sampling_params.pooling
            if pooling is None:
                raise ValueError(f"request {new.request_id}: an encoder model only embeds")
            self._pending[new.request_id] = (new.prompt_token_ids, pooling)
        if so.is_empty:
            return ModelOutput(req_ids=[], sampled_token_ids=[])
        ids = list(so.num_scheduled_tokens)
        prompts = [self._pending.pop(rid) for rid in ids]
        for rid, (prompt, _) in zip(ids, prompts, strict=True):
            if so.num_scheduled_tokens[rid] != len(prompt):  # the scheduler never chunks them
                raise RuntimeError(f"encoder request {rid} was scheduled in part")
        lengths = [len(p) for p, _ in prompts]
        batch = torch.full((len(ids), max(lengths)), self.pad_token_id, dtype=torch.long)
        for row, (prompt, _) in enumerate(prompts):
            batch[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        lens = torch.tensor(lengths, dtype=torch.long, device=self.device)
        t1 = time.perf_counter()
        if isinstance(self.model, BertForSequenceClassification):
            typed = self.model.shape.type_vocab_size > 1  # XLM-R: one token type
            starts = [p.pair_start if typed else None for _, p in prompts]
            types = _token_types(batch.shape, starts, lengths)
            scores = self.model(batch.to(self.device), lens, types.to(self.device)).cpu()
            t2 = time.perf_counter()
            pooled = {rid: scores[row].tolist() for row, rid in enumerate(ids)}
        else:
            hidden = self.model(batch.to(self.device), lens)
            vectors = self._pool(hidden, lens)
            t2 = time.perf_counter()
            pooled = {
                rid: finish_vector(vectors[row], self.pooler, params)
                for row, (rid, (_, params)) in enumerate(zip(ids, prompts, strict=True))
            }
        t3 = time.perf_counter()
        return ModelOutput(
            req_ids=[],
            sampled_token_ids=[],
            pooled=pooled,
            prepare_time=t1 - t0,
            forward_time=t2 - t1,
            sample_time=t3 - t2,
        )

    def _pool(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, L, H] padded states -> [B, H] float32 pooled vectors."""
        kind = self.pooler.pooling_type
        if kind == "CLS":
            return hidden[:, 0].float()
        if kind == "LAST":
            return hidden[torch.arange(len(lengths)), lengths - 1].float()
        valid = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]
        summed = (hidden.float() * valid[..., None]).sum(dim=1)
        return summed / lengths[:, None].float()


def _token_types(
    shape: torch.Size, pair_starts: list[int | None], lengths: list[int]
) -> torch.Tensor:
    """[B, L] token types: 1 on each row's second text (``pair_start`` up to its length)."""
    types = torch.zeros(shape, dtype=torch.long)
    for row, (start, length) in enumerate(zip(pair_starts, lengths, strict=True)):
        if start is not None:
            types[row, start:length] = 1
    return types
