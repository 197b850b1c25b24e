"""The model runner's state: what ``ModelRunner`` (``model_runner``) holds across steps and how
a step's ``SchedulerOutput`` diffs update it before the forward.

Built once per rank: the model and its LoRA wrappers, the KV cache (and the CUDA graph
runner, the draft model's cache), the persistent ``InputBatch`` rows, the optional CPU
compiled forward, the image encoder's cache, the pooler of an embedding model and the
engine's ``RowSampler``. Per request: a ``CachedRequestState`` (token ids, block ids, row,
sampling generator) added by ``new_reqs``, extended by ``cached_reqs``, and dropped (its row
released, its images, pooling and draft state forgotten) when it finishes or is preempted.
"""

from __future__ import annotations

import torch

from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.loader.model_loader import LoadedModel
from tokenwire.runtime.lora.manager import LoRAManager
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.models.windows import distinct_chunks, distinct_windows
from tokenwire.runtime.sample.sampler import Sampler
from tokenwire.runtime.sample.sampling_metadata import RowSamplingState
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.worker.attention_inputs import AttentionInputs
from tokenwire.runtime.worker.cpu_compile import CompiledCpuForward, compile_cpu_forward
from tokenwire.runtime.worker.image_embeds import ImageEmbeds, add_images
from tokenwire.runtime.worker.input_batch import InputBatch
from tokenwire.runtime.worker.pooler import Pooler
from tokenwire.runtime.worker.request_state import CachedRequestState
from tokenwire.runtime.worker.runner_caches import build_caches
from tokenwire.runtime.worker.runner_settings import RunnerSettings
from tokenwire.runtime.worker.sample_rows import RowSampler

_SINGLE = TPGroup.single()  # immutable: the default group of one


class RunnerState:
    """The runner's device side (model, KV cache, persistent rows, samplers) and the
    per-request state that each ``SchedulerOutput``'s diffs update (``ModelRunner`` runs
    the step on it)."""

    def __init__(
        self,
        loaded: LoadedModel,
        settings: RunnerSettings,
        device: torch.device,
        tp: TPGroup = _SINGLE,
        draft: LoadedModel | None = None,
        spec_tokens: int = 0,
    ) -> None:
        """``settings``: derived once from the engine config (``RunnerSettings.from_config``);
        ``draft``: the draft model of ``draft_model`` speculation; its KV cache shares the
        budget and the block ids of the target's; ``spec_tokens``: ``num_speculative_tokens``
        (0: no speculation), the drafts per row that CUDA verify graphs are captured for."""
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
        # LoRA wraps the model's linears before any CUDA graph is captured: the decode graphs
        # record its segmented path and replay each step's runs (``cuda_graphs``).
        self.lora: LoRAManager | None = None
        if settings.lora.enable_lora:
            self.lora = LoRAManager(self.model, settings.lora, loaded.dtype, device)
        caches = build_caches(
            loaded, draft, settings, device, tp.world_size, spec_tokens, self.lora
        )
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
