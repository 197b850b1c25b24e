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
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.loader.model_loader import LoadedModel
from tokenwire.runtime.lora.manager import LoRAManager
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.model_output import ModelOutput, TokenLogprobs
from tokenwire.runtime.models.windows import distinct_chunks, distinct_windows
from tokenwire.runtime.sample.sampler import Sampler
from tokenwire.runtime.sample.sampling_metadata import RowSamplingState
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.structured.bitmask import GrammarBitmask
from tokenwire.runtime.worker.attention_inputs import AttentionInputs
from tokenwire.runtime.worker.cpu_compile import CompiledCpuForward, compile_cpu_forward
from tokenwire.runtime.worker.image_embeds import EncoderWork, ImageEmbeds, add_images
from tokenwire.runtime.worker.input_batch import InputBatch, StepArrays
from tokenwire.runtime.worker.pooler import Pooler, pool_rows
from tokenwire.runtime.worker.prompt_logprobs import prompt_logprobs_for_step
from tokenwire.runtime.worker.request_state import CachedRequestState
from tokenwire.runtime.worker.runner_caches import build_caches
from tokenwire.runtime.worker.runner_settings import RunnerSettings
from tokenwire.runtime.worker.sample_rows import RowSampler, StepTokens, sample_rows
from tokenwire.runtime.worker.spec.verify_step import plan_verify, verify_rows, write_drafts

_SINGLE = TPGroup.single()  # immutable: the default group of one
# No image request: no embeddings or spans; 1D positions (M-RoPE's text rows: the same).
_NO_IMAGES: tuple[None, ImageSpans, None] = (None, (), None)


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        settings: RunnerSettings,
        device: torch.device,
        tp: TPGroup = _SINGLE,
        draft: LoadedModel | None = None,
    ) -> None:
        """``settings``: derived once from the engine config (``RunnerSettings.from_config``);
        ``draft``: the draft model of ``draft_model`` speculation; its KV cache shares the
        budget and the block ids of the target's."""
        model_tp = loaded.model.tp
        if (model_tp.rank, model_tp.world_size) != (tp.rank, tp.world_size):
            raise ValueError(
                f"the model was built for TP rank {model_tp.rank} of {model_tp.world_size}, "
                f"the runner for rank {tp.rank} of {tp.world_size}"
            )
        self.tp = tp
        self.model = loaded.model
        self.eos_token_ids = loaded.eos_token_ids
        self.device = device
        self.block_size = settings.cache.block_size
        # Each distinct sliding window of the layers gets its own CPU attention plan per step.
        self.inputs = AttentionInputs(
            device, self.block_size, distinct_windows(loaded.arch), distinct_chunks(loaded.arch)
        )
        # LoRA wraps the model's linears before any CUDA graph is captured (decode graphs are
        # off with LoRA: ``settings.enforce_eager``).
        self.lora: LoRAManager | None = None
        if settings.lora.enable_lora:
            self.lora = LoRAManager(self.model, settings.lora, loaded.dtype, device)
        caches = build_caches(loaded, draft, settings, device, tp.world_size)
        self.kv_cache = caches.kv_cache
        self._cuda = caches.cuda
        self.drafter = caches.drafter
        self.batch = InputBatch(settings.max_num_seqs, loaded.max_model_len, self.block_size)
        self._compiled: CompiledCpuForward | None = None
        if settings.cpu_compile:  # --cpu-compile: compiled and warmed up here
            self._compiled = compile_cpu_forward(
                self.model, self.kv_cache.layers, self.inputs, device, settings.lora.enable_lora
            )
        self.requests: dict[str, CachedRequestState] = {}
        # A vision-language model: each request's images, encoded when a step reaches them.
        self.images = ImageEmbeds.for_model(self.model, device, settings.max_num_batched_tokens)
        self._num_prompt_logprob_reqs = 0  # live requests that asked for prompt logprobs
        # Embedding models: pools the hidden states of embedding requests (prefill only).
        self.pooler = None if loaded.embed is None else Pooler(loaded.embed.pooler)
        self._num_pooling_reqs = 0  # live embedding requests
        # Generator for unseeded random rows: reproducible per engine seed, not global state.
        generator = torch.Generator(device=device)
        generator.manual_seed(settings.seed)
        self.sampling = RowSampler(Sampler(), generator, loaded.arch.vocab_size, device)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    # ------------------------------------------------------------------ state diffs
    def _update_states(self, so: SchedulerOutput) -> None:
        if so.removed_lora_ids and self.lora is not None:
            self.lora.remove(so.removed_lora_ids)
        if self.drafter is not None:
            for request_id in (*so.finished_req_ids, *so.preempted_req_ids):
                self.drafter.forget(request_id)
        for request_id in so.finished_req_ids:
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            if state.row is not None:
                self.batch.release_row(state.row)
            if self.images is not None:
                self.images.forget(request_id)
            if state.params.prompt_logprobs is not None:
                self._num_prompt_logprob_reqs -= 1
            if state.params.pooling is not None:
                self._forget_pooling(request_id, finished=True)
        for request_id in so.preempted_req_ids:
            state = self.requests.get(request_id)
            if state is not None and state.params.pooling is not None:
                self._forget_pooling(request_id, finished=False)
            if state is not None and state.row is not None:
                self.batch.release_row(state.row)
                state.row = None
        for new in so.new_reqs:
            self._add_request(
                new.request_id,
                new.prompt_token_ids,
                new.sampling_params,
                new.block_ids,
                new.num_computed_tokens,
                new.lora_request,
            )
            add_images(self.images, new.request_id, new.images, len(new.prompt_token_ids))
        cached = so.cached_reqs
        requests, batch = self.requests, self.batch
        for request_id, resumed, new_block_ids, num_computed in zip(
            cached.request_ids,
            cached.resumed_from_preemption,
            cached.new_block_ids,
            cached.num_computed_tokens,
            strict=True,
        ):
            state = requests[request_id]
            if resumed:  # its old row was released at preemption
                state.block_ids = list(new_block_ids)
                state.row = batch.add_row(state.all_token_ids(), state.block_ids, num_computed)
                continue
            assert state.row is not None
            state.block_ids.extend(new_block_ids)
            batch.append_blocks(state.row, new_block_ids)

    def _add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        block_ids: list[int],
        num_computed: int,
        lora: LoRARequest | None = None,
    ) -> None:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        output: list[int] = []
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        sampling = RowSamplingState(
            params=params,
            generator=generator,
            prompt_token_ids=prompt,
            output_token_ids=output,
            stop_token_ids_for_min_tokens=stop_ids,
        )
        state = CachedRequestState(
            request_id, list(prompt), output, params, list(block_ids), sampling, lora
        )
        state.row = self.batch.add_row(prompt, state.block_ids, num_computed)
        self.requests[request_id] = state
        if params.prompt_logprobs is not None:
            self._num_prompt_logprob_reqs += 1
        if params.pooling is not None:
            if self.pooler is None:
                raise ValueError(f"request {request_id}: this model serves no embeddings")
            self._num_pooling_reqs += 1

    def _forget_pooling(self, request_id: str, *, finished: bool) -> None:
        assert self.pooler is not None
        self.pooler.forget(request_id)
        if finished:
            self._num_pooling_reqs -= 1

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
