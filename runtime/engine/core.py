"""EngineCore: ``step()`` = schedule -> execute -> update, over token ids only.

Text (tokenization, detokenization, stop strings) lives in the front (``OutputProcessor``);
the core validates token-level limits, runs steps, and reports plain ``StepStats`` and
``RequestStats`` records to an optional observer. Not thread-safe: one thread drives it.
"""

from __future__ import annotations

import time

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.core.kv_cache_manager import KVCacheManager
from tokenwire.runtime.core.kv_connector_api import KVConnector
from tokenwire.runtime.core.kv_events import AnyKVEvent, KVEventRecorder
from tokenwire.runtime.core.kv_tier_setup import attach_offloading
from tokenwire.runtime.core.request import Request
from tokenwire.runtime.core.scheduler import Scheduler
from tokenwire.runtime.core.spec.draft_slots import make_proposer
from tokenwire.runtime.engine.async_steps import carries_work, make_stepper
from tokenwire.runtime.engine.core_stats import request_stats, step_stats
from tokenwire.runtime.engine.fault import step_fault_from_env
from tokenwire.runtime.errors import DuplicateRequestError, ParameterError
from tokenwire.runtime.executor.base import Executor
from tokenwire.runtime.executor.factory import make_executor
from tokenwire.runtime.front.validation import check_task, validate_request
from tokenwire.runtime.lora.admission import LoRAAdmission
from tokenwire.runtime.lora.registry import LoRARegistry
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.models.windows import every_layer_window
from tokenwire.runtime.multimodal import ImageInput, check_images, salted_images
from tokenwire.runtime.outputs import EngineCoreOutput, FinishReason
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.stats import EngineObserver
from tokenwire.runtime.structured.compiler import GrammarCompilerPool
from tokenwire.runtime.structured.manager import StructuredOutputManager

# An engine whose only work is requests waiting for their grammar blocks this long per step
# (on the compile futures) instead of spinning.
GRAMMAR_WAIT_S = 0.01


class EngineCore:
    """``executor``: what runs the model (default: built from ``config``; a test may pass
    one). The core itself holds no model and no device tensors, only ``facts``."""

    def __init__(
        self,
        config: EngineConfig,
        observer: EngineObserver | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.config = config
        self.observer = observer
        self._fault = step_fault_from_env()  # TOKENWIRE_TEST_FAULT (tests only); else None
        self.executor = executor if executor is not None else make_executor(config)
        try:
            self.facts = self.executor.facts
            self.max_model_len = self.facts.max_model_len
            self.vocab_size = self.facts.vocab_size
            self._check_capacity(self.facts.num_blocks)
            self._eos_token_ids = frozenset(self.facts.eos_token_ids)
            self.loras = LoRARegistry(config.lora, self.facts.arch)
            self.loras.load_startup_modules()
        except BaseException:
            self.executor.shutdown()
            raise
        events = config.kv_events_config
        self.kv_cache_manager = KVCacheManager(
            self.facts.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            every_layer_window(self.facts.arch),
            KVEventRecorder(config.cache.block_size)
            if events is not None and events.enable_kv_cache_events
            else None,
        )
        max_held = int(self.kv_cache_manager.num_blocks * config.cache.session_cache_fraction)
        pool = GrammarCompilerPool(
            self.facts.tokenizer_path,
            self.vocab_size,
            self.facts.eos_token_ids,
            config.structured_outputs,
        )
        self.structured = StructuredOutputManager(pool, self.vocab_size)
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_cache_manager,
            self.max_model_len,
            max_held,
            self.structured,
            LoRAAdmission(config.lora.max_loras) if config.lora.enable_lora else None,
            make_proposer(config.speculative_config, self.max_model_len),
            self._make_connector(),
            encoder_only=self.facts.encoder,
        )
        # --async-scheduling: keeps one step in flight (engine.async_steps); None: sync steps.
        self._stepper = make_stepper(
            config,
            self.executor,
            self.scheduler,
            self.structured,
            None if observer is None else self._report_step,
            self._fault,
            GRAMMAR_WAIT_S,
        )

    def _make_connector(self) -> KVConnector | None:
        """KV tiers (docs/kv-tiers.md): the host tier when the worker sized one."""
        if not self.facts.num_offload_blocks or not self.config.cache.enable_prefix_caching:
            return None
        f = self.facts  # the disk tier (0: off) is seeded with what a warm restart found
        return attach_offloading(
            self.kv_cache_manager, f.num_offload_blocks, f.kv_block_bytes, f.num_disk_blocks,
            f.disk_entries, self.config.cache.session_cache_fraction,
            self.config.cache.kv_offloading_eviction_policy,
        )  # fmt: skip

    def _check_capacity(self, num_blocks: int) -> None:
        """One request of ``max_model_len`` tokens must fit alone. With a window on every
        layer it holds at most one window plus one scheduled chunk (and a partial block at
        each end), since the KV cache manager frees the blocks behind the window."""
        block_size = self.config.cache.block_size
        capacity = (num_blocks - 1) * block_size  # block 0 is the null block
        needed = self.max_model_len
        if self.facts.encoder and self.config.scheduler.max_num_batched_tokens < needed:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len for an encoder model (its "
                f"prompts run whole, never chunked): {self.config.scheduler.max_num_batched_tokens}"
                f" < {needed}; raise --max-num-batched-tokens or lower --max-model-len"
            )
        window = every_layer_window(self.facts.arch)
        if window is not None:
            chunk = self.config.scheduler.max_num_batched_tokens
            needed = min(needed, window + chunk + 2 * block_size)
        if capacity < needed:
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than the {needed} that one "
                f"max_model_len ({self.max_model_len}) sequence needs: raise the KV cache "
                "budget or lower --max-model-len"
            )

    def check_health(self) -> None:
        """Raise when the executor can no longer run steps (a worker process died)."""
        self.executor.check_health()

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the executor (its worker processes, under tensor parallelism): ``graceful``
        after a clean stop, at once after a failure."""
        self.structured.shutdown()
        if self._stepper is not None:
            self._stepper.discard()
        self.executor.shutdown(graceful)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        hold_as: str | None = None,
        lora_request: LoRARequest | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> None:
        """Validate against the model and queue. ``params.n`` must be 1 (the front fans out).
        ``images``: the prompt's images, placeholders already expanded (``front.images``).

        ``hold_as``: keep the request's KV blocks referenced under this holder id after it
        finishes (sessions); ``release_holder`` drops them.
        """
        if request_id in self.scheduler.requests:
            raise DuplicateRequestError(request_id)
        self.validate(prompt_token_ids, params)
        if lora_request is not None:
            self.loras.check(lora_request)
        check_images(images, len(prompt_token_ids), self._max_image_tokens(images))
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            self._eos_token_ids,
            self.max_model_len,
            arrival_time=arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            hold_as=hold_as,
            lora_request=lora_request,
            images=salted_images(images, cache_salt),  # isolated per salt (``multimodal``)
        )
        self.scheduler.add_request(request)

    def _max_image_tokens(self, images: tuple[ImageInput, ...]) -> int:
        """An image's feature tokens must fit the encoder cache; without chunked prefill a
        request's images are encoded in one step, so all of them must (``core.encoder_cache``)."""
        capacity = self.scheduler.encoder.capacity
        if images and not self.config.scheduler.enable_chunked_prefill:
            distinct = sum({image.content_hash: image.length for image in images}.values())
            if distinct > capacity:
                raise ParameterError(
                    "multi_modal_data",
                    f"the images' {distinct} feature tokens exceed the encoder cache's "
                    f"{capacity} (--encoder-cache-size; without chunked prefill a prompt's "
                    "images are encoded in one step)",
                )
        return capacity

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_task(self.facts.served_model_name, self.facts.embed, params)
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)

    def abort_requests(
        self, request_ids: list[str], reason: FinishReason = FinishReason.CANCELLED
    ) -> list[EngineCoreOutput]:
        aborted = self.scheduler.abort_requests(request_ids, reason)
        drained: list[EngineCoreOutput] = []
        if self._stepper is not None and not self.scheduler.has_unfinished_requests():
            drained = self._stepper.collect()  # nothing live: reconcile the step in flight
        self._report_finished()
        return drained + [
            EngineCoreOutput(
                r.request_id,
                [],
                finish_reason=reason,
                num_cached_tokens=max(r.num_cached_tokens, 0),
            )
            for r in aborted
        ]

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Check and register an adapter (``AdapterError`` / ``AdapterExistsError``)."""
        return self.loras.add(name, path)

    def remove_lora(self, name: str) -> LoRARequest:
        """Unregister ``name`` at once; the workers drop it after its last request."""
        request = self.loras.remove(name)
        if self.scheduler.lora is not None:
            self.scheduler.lora.remove(request.lora_int_id)
        return request

    def get_lora(self, name: str) -> LoRARequest | None:
        return next((r for r in self.loras.adapters() if r.lora_name == name), None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.step_in_flight

    @property
    def step_in_flight(self) -> bool:
        """Async scheduling: a submitted step is not reconciled yet (it runs while the caller
        handles what ``step()`` returned)."""
        return self._stepper is not None and self._stepper.in_flight

    def release_holder(self, holder_id: str) -> bool:
        """Free the KV blocks a finished request left under ``holder_id``."""
        return self.scheduler.release_holder(holder_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, on the device and in the KV tiers (refused, False, while
        any block is in use, a tier load runs or a Session holds host slots)."""
        if not self.kv_cache_manager.reset_prefix_cache():
            return False
        connector = self.scheduler.connector
        if connector is None:
            return True
        if not connector.reset():
            return False
        if not self.has_unfinished_requests():
            # Idle: zero the disk tier's records now (else the next step's plan carries it).
            so = self.scheduler.schedule()
            if carries_work(so):
                self.scheduler.update(so, self.executor.execute_model(so))
        return True

    def take_kv_events(self) -> list[AnyKVEvent]:
        """KV-cache events recorded since the last call ([] when they are off)."""
        events = self.kv_cache_manager.kv_events
        return [] if events is None else events.take()

    def pop_evicted_holders(self) -> list[str]:
        """Holders whose blocks were released under memory pressure since the last call."""
        return self.scheduler.pop_evicted_holders()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[EngineCoreOutput]:
        if self._stepper is not None:  # async scheduling: one step in flight
            outputs = self._stepper.step()
            self._report_finished()
            return outputs
        started_ns = time.time_ns()
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        t1 = time.perf_counter()
        # An empty step still goes out when it finishes or preempts requests: the workers
        # must release their rows (a request that preempted itself used to leak one).
        # So does one with KV-tier copies to make or loads to wait for.
        if not carries_work(so):
            if self.structured.num_pending:
                self.structured.wait(GRAMMAR_WAIT_S)
            return []
        if self._fault is not None:
            self._fault.before_execute()
        mo = self.executor.execute_model(so)
        t2 = time.perf_counter()
        outputs = self.scheduler.update(so, mo)
        t3 = time.perf_counter()
        if self.observer is not None and not so.is_empty:
            self._report_step(so, mo, t1 - t0, t3 - t2, started_ns, t3 - t0)
        self._report_finished()
        return outputs

    # ------------------------------------------------------------------ observer
    def _report_step(
        self,
        so: SchedulerOutput,
        mo: ModelOutput,
        schedule: float,
        update: float,
        started_ns: int,
        duration: float,
    ) -> None:
        assert self.observer is not None
        self.observer.on_step(
            step_stats(
                so, mo, self.kv_cache_manager, self.scheduler.num_waiting,
                self.config.parallel.data_parallel_rank, schedule, update, started_ns, duration,
            )
        )  # fmt: skip

    def _report_finished(self) -> None:
        finished = self.scheduler.pop_finished_requests()
        if self.observer is None:
            return
        dp_rank, block_size = self.config.parallel.data_parallel_rank, self.config.cache.block_size
        for request in finished:
            self.observer.on_request_finished(request_stats(request, dp_rank, block_size))
