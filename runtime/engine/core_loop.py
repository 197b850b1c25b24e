"""``CoreLoop``: the busy loop that drives an ``EngineCore`` from input records (vLLM v1's
``EngineCoreProc`` loop), the same code on a thread of the front or in the core's own process.

Each turn applies every queued input (blocking only while the core has nothing to do), runs
one step when there is work, and sends one ``StepResult`` with the step's outputs, the step
and request statistics the core reported, evicted session holders and a state snapshot.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable

from tokenwire.runtime.core.kv_events import KVEventBatch
from tokenwire.runtime.core.request import Request
from tokenwire.runtime.engine.core import EngineCore
from tokenwire.runtime.engine.messages import (
    AbortRequests,
    AddLoRA,
    AddRequest,
    CheckIdle,
    CoreInput,
    CoreOutput,
    IdleReply,
    LoRAReply,
    ReleaseHolder,
    RemoveLoRA,
    RequestFault,
    ResetPrefixCache,
    ResetReply,
    Shutdown,
    StepResult,
)
from tokenwire.runtime.engine.protocol import EngineInfo, EngineStatsSnapshot, IdleReport
from tokenwire.runtime.errors import AdapterError, AdapterExistsError, AdapterNotFoundError
from tokenwire.runtime.front.tokenizer import load_chat_template
from tokenwire.runtime.loader.generation_config import loaded_model_defaults
from tokenwire.runtime.outputs import EngineCoreOutput
from tokenwire.runtime.stats import EngineObserver, RequestStats, StepStats

# block -> the inputs queued now; blocking waits at most IDLE_CHECK_S (then maybe none).
Receive = Callable[[bool], list[CoreInput]]
IDLE_CHECK_S = 1.0  # an idle core checks its executor's workers this often
Send = Callable[[CoreOutput], None]
logger = logging.getLogger("tokenwire.engine")


class StatsCollector:
    """The core's observer: keeps what a step reported until the loop ships it, and passes
    each event on to ``extra`` first (a core-side observer, e.g. a test's step gate)."""

    def __init__(self, extra: EngineObserver | None = None) -> None:
        self.extra = extra
        self.steps: list[StepStats] = []
        self.finished: list[RequestStats] = []

    def on_step(self, stats: StepStats) -> None:
        if self.extra is not None:
            self.extra.on_step(stats)
        self.steps.append(stats)

    def on_request_finished(self, stats: RequestStats) -> None:
        if self.extra is not None:
            self.extra.on_request_finished(stats)
        self.finished.append(stats)

    def take(self) -> tuple[list[StepStats], list[RequestStats]]:
        steps, finished = self.steps, self.finished
        self.steps, self.finished = [], []
        return steps, finished


def engine_info(core: EngineCore) -> EngineInfo:
    facts, config = core.facts, core.config
    return EngineInfo(
        served_model_name=facts.served_model_name,
        architecture=facts.arch.architecture,
        dtype=facts.dtype,
        device=facts.device,
        max_model_len=core.max_model_len,
        vocab_size=core.vocab_size,
        eos_token_ids=facts.eos_token_ids,
        num_kv_blocks=core.kv_cache_manager.num_blocks,
        block_size=config.cache.block_size,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        quantization=facts.quantization,
        tensor_parallel_size=facts.tensor_parallel_size,
        tokenizer_path=facts.tokenizer_path,
        core_pid=os.getpid(),
        weight_bytes=facts.weight_bytes,
        kv_bytes_per_token=facts.kv_bytes_per_token,
        kv_cache_dtype="fp8" if config.cache.kv_cache_dtype != "auto" else "auto",
        max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
        max_lora_rank=config.lora.max_lora_rank if config.lora.enable_lora else 0,
        lora_adapters=core.loras.adapters(),
        chat_template=load_chat_template(config.model.chat_template),
        allow_content_special_tokens=config.model.allow_content_special_tokens,
        default_sampling=loaded_model_defaults(config.model, facts.model_path),
        embed=facts.embed,
        model_path=facts.model_path,
    )


def snapshot(core: EngineCore, step_id: int) -> EngineStatsSnapshot:
    scheduler, kv = core.scheduler, core.kv_cache_manager
    return EngineStatsSnapshot(
        step_id=step_id,
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        kv_cache_usage=kv.usage,
        kv_blocks_free=kv.num_free_blocks,
        kv_blocks_total=kv.num_blocks,
        num_held_blocks=kv.num_held_blocks,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions_total,
        running_lora_adapters=_adapter_names(scheduler.running) if scheduler.lora else (),
        waiting_lora_adapters=_adapter_names(scheduler.waiting) if scheduler.lora else (),
        kv_offload=None if scheduler.connector is None else scheduler.connector.stats(),
    )


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    names = {r.lora_request.lora_name for r in requests if r.lora_request is not None}
    return tuple(sorted(names))


def lora_reply(core: EngineCore, message: AddLoRA | RemoveLoRA) -> LoRAReply:
    """Apply an adapter load / unload; a refusal travels back as data (the core lives on).

    An adapter's files are the client's data: whatever reading them raises (the readers
    raise only ``AdapterError``; anything else is a reader bug) refuses that load, never
    the engine. The registry changes only once every check has passed."""
    try:
        if isinstance(message, AddLoRA):
            lora = core.add_lora(message.name, message.path)
        else:
            lora = core.remove_lora(message.name)
    except AdapterError as exc:
        return LoRAReply(message.call_id, error="invalid", param=exc.param, message=str(exc))
    except AdapterExistsError as exc:
        return LoRAReply(message.call_id, error="exists", message=str(exc))
    except AdapterNotFoundError as exc:
        return LoRAReply(message.call_id, error="not_found", message=str(exc))
    except Exception as exc:  # never a traceback or a path: the type names the failure
        logger.warning("refused a LoRA adapter whose files failed to read: %s", type(exc).__name__)
        text = f"the adapter's files cannot be read ({type(exc).__name__})"
        return LoRAReply(message.call_id, error="invalid", param="lora_path", message=text)
    return LoRAReply(message.call_id, lora=lora)


def idle_report(core: EngineCore) -> IdleReport:
    kv, connector = core.kv_cache_manager, core.scheduler.connector
    try:
        kv.check_invariants()
        if connector is not None:  # KV tiers: the host (and disk) tier's own invariants
            connector.check_invariants()
        error = None
    except AssertionError as exc:
        error = str(exc)
    return IdleReport(
        has_unfinished_requests=core.has_unfinished_requests(),
        num_free_blocks=kv.num_free_blocks,
        num_blocks=kv.num_blocks,
        num_held_blocks=kv.num_held_blocks,
        invariant_error=error,
        num_tier_held_blocks=0 if connector is None else connector.stats().session_blocks,
    )


class CoreLoop:
    def __init__(
        self, core: EngineCore, collector: StatsCollector, receive: Receive, send: Send
    ) -> None:
        self.core = core
        self.collector = collector
        self.receive = receive
        self.send = send
        self._step_id = 0
        self._outputs: list[EngineCoreOutput] = []
        self._faults: list[RequestFault] = []
        self._released = False  # a holder's blocks were freed: the snapshot must go out

    def run(self) -> None:
        """Until a ``Shutdown`` input; exceptions propagate (the caller reports them)."""
        core = self.core
        while True:
            idle = not core.has_unfinished_requests()
            messages = self.receive(idle)
            if idle and not messages:  # nothing for IDLE_CHECK_S: are the workers alive?
                core.check_health()
                continue
            for message in messages:
                if isinstance(message, Shutdown):
                    return
                self._apply(message)
            if core.has_unfinished_requests():
                self._outputs.extend(core.step())
                self._step_id += 1
            self._flush()

    def _apply(self, message: CoreInput) -> None:
        core = self.core
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequests):
            self._outputs.extend(core.abort_requests(message.request_ids))
        elif isinstance(message, ReleaseHolder):
            # At idle no step follows: without a flush the KV gauges would keep the blocks.
            self._released |= core.release_holder(message.holder_id)
        elif isinstance(message, AddLoRA | RemoveLoRA):
            self._flush()
            self.send(lora_reply(core, message))
        elif isinstance(message, ResetPrefixCache):
            ok = core.reset_prefix_cache()
            self._flush()  # the AllBlocksCleared event goes out before the answer
            self.send(ResetReply(message.call_id, ok))
        elif isinstance(message, CheckIdle):
            self._flush()  # everything before the question goes out before the answer
            self.send(IdleReply(message.call_id, idle_report(core)))

    def _add(self, message: AddRequest) -> None:
        added: list[str] = []
        try:
            for child in message.children:
                self.core.add_request(
                    child.request_id,
                    message.prompt_token_ids,
                    child.params,
                    priority=message.priority,
                    cache_salt=message.cache_salt,
                    hold_as=child.hold_as,
                    lora_request=message.lora_request,
                    images=message.images,
                )
                added.append(child.request_id)
        except Exception as exc:  # validated by the front already: an engine fault
            self.core.abort_requests(added)  # their outputs are dropped: the request failed
            self._faults.append(RequestFault(message.request_id, type(exc).__name__))

    def _flush(self) -> None:
        steps, finished = self.collector.take()
        evicted = self.core.pop_evicted_holders()
        events = self.core.take_kv_events()
        pending = self._outputs or steps or finished or evicted or self._faults or self._released
        if not (pending or events):
            return
        rank = self.core.config.parallel.data_parallel_rank  # KV events name their core
        result = StepResult(
            outputs=self._outputs,
            steps=steps,
            finished=finished,
            evicted_holders=evicted,
            faults=self._faults,
            snapshot=snapshot(self.core, self._step_id),
            kv_events=KVEventBatch(time.time(), events, rank) if events else None,
        )
        self._outputs, self._faults, self._released = [], [], False
        self.send(result)
