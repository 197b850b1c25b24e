"""Executor: owns the device, the model and the paged KV cache; runs one step per call.

``execute_model(SchedulerOutput) -> ModelOutput``. The runner keeps its own per-request
state (token ids, block table row, sampling generator) so only diffs cross the seam. Step
inputs are gathered with vectorised numpy over persistent rows (``InputBatch``); the only
host sync in a step is reading the sampled token ids. On CUDA the forward goes through
``CudaGraphRunner`` (profiled KV sizing, pinned staging buffers, decode CUDA graphs); the CPU
path below is untouched by it.

Calls go downward only: the runner hands its helpers explicit inputs and none of them imports
it. ``sample_rows`` gets the ``RowSampler`` (sampler, engine generator, vocabulary size,
device), the ``InputBatch`` and the rows' logits; ``prompt_logprobs_for_step`` the step's
arrays, hidden states and ``compute_logits``; the speculative verify step (``plan_verify`` /
``verify_rows``) the batch, the ``RowSampler`` and the logits the runner computed for its
plan; the draft model the batch (it builds its own inputs with an ``AttentionInputs``).

Tensor parallelism: every rank runs this same runner on the same ``SchedulerOutput``s with its
share of the model (``load_model(..., tp=group)``) and passes the same ``tp``; the KV cache
holds the rank's local KV heads. ``compute_logits`` gathers the full vocabulary on every rank
(a collective), so every rank samples identically and makes the same collective calls in the
same order; the driver (rank 0) returns the ``ModelOutput``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np
import torch
from torch import Tensor

from tokenwire.kernels.attention_metadata import ImageSpans
from tokenwire.runtime.model_output import ModelOutput, TokenLogprobs
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.structured.bitmask import GrammarBitmask
from tokenwire.runtime.worker.image_embeds import EncoderWork
from tokenwire.runtime.worker.input_batch import StepArrays
from tokenwire.runtime.worker.pooler import pool_rows
from tokenwire.runtime.worker.prompt_logprobs import prompt_logprobs_for_step
from tokenwire.runtime.worker.request_state import CachedRequestState
from tokenwire.runtime.worker.runner_state import RunnerState
from tokenwire.runtime.worker.sample_rows import StepTokens, sample_rows
from tokenwire.runtime.worker.spec.verify_step import plan_verify, verify_rows, write_drafts

# No image request: no embeddings or spans; 1D positions (M-RoPE's text rows: the same).
_NO_IMAGES: tuple[None, ImageSpans, None] = (None, (), None)


class ModelRunner(RunnerState):
    """One step per ``execute_model`` call on the state ``RunnerState`` holds (built by its
    ``__init__``: the loaded model, the ``RunnerSettings``, the device, the TP group and the
    optional draft model)."""

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute_model(
        self, so: SchedulerOutput, late_bitmask: Future[GrammarBitmask | None] | None = None
    ) -> ModelOutput:
        t0 = time.perf_counter()
        collective0 = self.tp.clock.seconds
        self._update_states(so)
        encoder = EncoderWork()
        if self.images is not None and (so.encoder_inputs or so.encoder_frees):
            encoder = self.images.run_encoder(so.encoder_inputs, so.encoder_frees)
        if so.is_empty:
            return ModelOutput(req_ids=[], sampled_token_ids=[])
        states, query_lens, num_decodes = self._batch_order(so)
        if self.lora is not None:
            order = self.lora.prepare_step([s.lora for s in states], query_lens, num_decodes)
            if order is not None:
                states, query_lens = [states[i] for i in order], query_lens[order]
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        drafts = so.spec_token_ids
        if drafts and self.drafter is not None:  # the scheduler sent placeholders
            drafts = self.drafter.propose(self.batch, states, drafts)
        if drafts:  # drafts go after each row's known tokens (not yet its own)
            write_drafts(self.batch, states, drafts)
        arrays = self.batch.build(rows, query_lens, num_decodes)
        self.batch.num_computed[rows] += query_lens  # after this step's forward
        images = self.images.step_inputs(states, arrays) if self.images else _NO_IMAGES
        embeds, spans, mrope = images
        t1, hidden = self._forward(arrays, embeds, spans, mrope)
        if drafts:
            t2, prompt_lps, out = self._verify(so, drafts, states, rows, arrays, hidden)
            pooled: dict[str, list[float]] = {}
        else:
            bitmask = so.grammar_bitmask if late_bitmask is None else late_bitmask
            t2, prompt_lps, out, pooled = self._sample(bitmask, states, rows, arrays, hidden)
        t3 = time.perf_counter()
        collective_time = self.tp.clock.seconds - collective0
        if drafts and self.drafter is not None:
            self.drafter.settle(self.batch, states)
        return ModelOutput(
            req_ids=out.req_ids,
            sampled_token_ids=out.token_ids,
            logprobs=out.logprobs,
            prompt_logprobs=prompt_lps,
            prepare_time=t1 - t0,
            forward_time=t2 - t1,
            sample_time=t3 - t2,
            collective_time=collective_time,
            extra_token_ids=out.extra_token_ids,
            extra_logprobs=out.extra_logprobs,
            pooled=pooled,
            num_images_encoded=encoder.num_images,
            encoder_time=encoder.seconds,
        )

    def _forward(
        self, arrays: StepArrays, embeds: Tensor | None, spans: ImageSpans, mrope: np.ndarray | None
    ) -> tuple[float, Tensor]:
        """(forward start time, hidden states): graph replay or eager on CUDA, else eager;
        ``embeds``, ``spans`` and ``mrope`` (M-RoPE's [3, T]; ``image_embeds``) run eagerly."""
        if self._cuda is not None:
            t1 = time.perf_counter()
            return t1, self._cuda.forward(arrays, embeds, spans, mrope)  # replay or eager
        inputs = self.inputs
        meta = inputs.metadata(arrays, spans)
        input_ids = inputs.to_device(arrays.input_ids)
        positions = inputs.to_device(arrays.positions if mrope is None else mrope)
        t1 = time.perf_counter()
        if self._compiled is not None and embeds is None:
            return t1, self._compiled.forward(input_ids, positions, meta)
        return t1, self.model(input_ids, positions, self.kv_cache.layers, meta, embeds)

    def _sample(
        self,
        bitmask: GrammarBitmask | Future[GrammarBitmask | None] | None,
        states: list[CachedRequestState],
        rows: np.ndarray,
        arrays: StepArrays,
        hidden: torch.Tensor,
    ) -> tuple[float, dict[str, list[TokenLogprobs | None]], StepTokens, dict[str, list[float]]]:
        """A plain step: (logits done time, prompt logprobs, the sampled tokens, the pooled
        vectors of embedding requests whose prompt completed)."""
        # A row samples when this step brings it up to date (not mid-way through a prefill).
        samples = arrays.seq_lens == self.batch.num_tokens[rows]
        pooled: dict[str, list[float]] = {}
        if self._num_pooling_reqs:
            assert self.pooler is not None
            pooled, samples = pool_rows(self.pooler, states, arrays, hidden, samples)
            if not samples.any():  # only embedding rows: nothing to sample
                t2 = time.perf_counter()
                return (
                    t2,
                    self._prompt_logprobs(states, arrays, hidden),
                    StepTokens([], [], {}),
                    pooled,
                )
        if samples.all():
            sample_states, rows_to_sample = states, rows
            last = hidden if len(hidden) == len(rows) else hidden[arrays.query_start_loc[1:] - 1]
        else:
            idx = np.flatnonzero(samples)
            sample_states, rows_to_sample = [states[i] for i in idx], rows[idx]
            last = hidden[torch.from_numpy(arrays.query_start_loc[1:][idx] - 1)]
        logits = self.model.compute_logits(last)
        t2 = time.perf_counter()
        prompt_lps = self._prompt_logprobs(states, arrays, hidden)
        if isinstance(bitmask, Future):  # async scheduling: built once step k is reconciled
            bitmask = bitmask.result()
        out = sample_rows(self.sampling, self.batch, logits, sample_states, rows_to_sample, bitmask)
        return t2, prompt_lps, out, pooled

    def _verify(
        self,
        so: SchedulerOutput,
        drafts: dict[str, list[int]],
        states: list[CachedRequestState],
        rows: np.ndarray,
        arrays: StepArrays,
        hidden: torch.Tensor,
    ) -> tuple[float, dict[str, list[TokenLogprobs | None]], StepTokens]:
        """A speculative step (``drafts``: the scheduler's n-gram drafts or the draft model's
        proposals): (logits done time, prompt logprobs, the emitted tokens)."""
        plan = plan_verify(self.batch, drafts, states, rows, arrays)
        logits = self.model.compute_logits(hidden[torch.from_numpy(plan.positions)])
        t2 = time.perf_counter()
        prompt_lps = self._prompt_logprobs(states, arrays, hidden)
        out = verify_rows(
            self.sampling, self.batch, plan, logits, states, rows, drafts, so.grammar_bitmask
        )
        return t2, prompt_lps, out

    def _prompt_logprobs(
        self, states: list[CachedRequestState], a: StepArrays, hidden: torch.Tensor
    ) -> dict[str, list[TokenLogprobs | None]]:
        if not self._num_prompt_logprob_reqs:
            return {}
        return prompt_logprobs_for_step(states, a, hidden, self.model.compute_logits)

    def _batch_order(self, so: SchedulerOutput) -> tuple[list[CachedRequestState], np.ndarray, int]:
        """Rows in batch order, decode rows (one query token) first: attention batches them."""
        scheduled = so.num_scheduled_tokens
        requests = self.requests
        if so.total_num_scheduled_tokens == len(scheduled):  # pure decode step
            states = [requests[rid] for rid in scheduled]
            return states, np.ones(len(states), dtype=np.int64), len(states)
        decodes = [rid for rid, n in scheduled.items() if n == 1]
        prefills = [rid for rid, n in scheduled.items() if n != 1]
        order = decodes + prefills
        query_lens = np.fromiter(
            (scheduled[rid] for rid in order), dtype=np.int64, count=len(order)
        )
        return [requests[rid] for rid in order], query_lens, len(decodes)
