"""``Worker``: one rank's model, KV-cache shard and ``ModelRunner`` on its own device.

``UniprocExecutor`` holds one worker in the core's process; with tensor parallelism each
worker process holds one (``worker_process``). The worker builds its model on its device from
its slices of the checkpoint, sizes its KV cache, and runs ``execute_model`` for every step.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future

import torch

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.loader.encoder_loader import LoadedEncoder, load_encoder, source_is_encoder
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model, resolve_dtype
from tokenwire.runtime.model_facts import ModelFacts
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.structured.bitmask import GrammarBitmask
from tokenwire.runtime.worker.cpu_tuning import keep_freed_memory
from tokenwire.runtime.worker.encoder_runner import EncoderRunner
from tokenwire.runtime.worker.kv_cache import kv_bytes_per_token
from tokenwire.runtime.worker.kv_load_agreement import LoadAgreement
from tokenwire.runtime.worker.kv_offload import KVOffloader, make_offloader
from tokenwire.runtime.worker.model_runner import ModelRunner
from tokenwire.runtime.worker.runner_settings import RunnerSettings
from tokenwire.runtime.worker.spec.draft_model import load_draft_model


def resolve_device(device: str, local_rank: int = 0, ranks_per_node: int = 1) -> torch.device:
    """The device of local rank ``local_rank``: ``cuda:<local_rank>`` under tensor
    parallelism; errors name the flag to change."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available: use --device cpu")
    if device == "cpu":
        return torch.device("cpu")
    if ranks_per_node == 1:
        return torch.device(device)
    if device != "cuda":
        raise ValueError(
            f"--device {device} names one GPU, but --tensor-parallel-size needs "
            f"{ranks_per_node} on this node: use --device cuda (rank i runs on cuda:i)"
        )
    available = torch.cuda.device_count()
    if ranks_per_node > available:
        raise ValueError(
            f"--tensor-parallel-size asks for {ranks_per_node} ranks on this node but it has "
            f"{available} CUDA device(s)"
        )
    return torch.device("cuda", local_rank)


def cpu_threads_per_rank(ranks_per_node: int) -> int:
    """Split the host's cores between the ranks of a CPU node instead of oversubscribing."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // ranks_per_node)


class Worker:
    def __init__(self, config: EngineConfig, device: torch.device, tp: TPGroup) -> None:
        self.config = config
        self.device = device
        self.tp = tp
        if device.type == "cpu":
            keep_freed_memory()
        dtype = resolve_dtype(config.model.dtype, device)
        settings = RunnerSettings.from_config(config)
        self.loaded: LoadedModel | LoadedEncoder
        self.runner: ModelRunner | EncoderRunner
        self.offload: KVOffloader | None
        if source_is_encoder(config.model):  # BERT family: bidirectional, no KV tensors
            if tp.world_size > 1:
                raise ValueError("--tensor-parallel-size: encoder models run on one device")
            self.loaded = load_encoder(config.model, device, dtype)
            self.runner = EncoderRunner(self.loaded, settings, device)
            self.offload = None  # no KV tensors: nothing to offload
            self.loads = LoadAgreement(tp)
            return
        loaded = load_model(config.model, device, dtype, tp)
        self.loaded = loaded
        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = load_draft_model(config.model, spec, loaded, tp)
        k = 0 if spec is None else spec.num_speculative_tokens
        self.runner = ModelRunner(loaded, settings, device, tp=tp, draft=draft, spec_tokens=k)
        # KV tiers: the host tier's copy engine (None: --kv-offloading-size is off).
        self.offload = make_offloader(
            config, self.runner.kv_cache, device, str(loaded.model_path), tp.rank
        )
        self.loads = LoadAgreement(tp)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        late_bitmask: Future[GrammarBitmask | None] | None = None,
    ) -> ModelOutput:
        """One step; ``late_bitmask``: its grammar bitmask, awaited only to sample (async
        scheduling, ``AsyncExecutor``)."""
        plan = scheduler_output.kv_transfers
        if plan is None or self.offload is None:
            return self._run(scheduler_output, late_bitmask)
        self.offload.start(plan)  # KV tiers: saves before the forward, loads start
        self.loads.started(plan.loads)
        output = self._run(scheduler_output, late_bitmask)
        # Finished on every rank (tensor parallel: each copies its own shard).
        done, failed = self.loads.agree(self.offload.finished(wait=scheduler_output.is_empty))
        if not done:
            return output
        return dataclasses.replace(output, kv_loads_done=done, kv_load_failed=failed)

    def _run(
        self, so: SchedulerOutput, late_bitmask: Future[GrammarBitmask | None] | None
    ) -> ModelOutput:
        if late_bitmask is None:
            return self.runner.execute_model(so)
        assert isinstance(self.runner, ModelRunner)  # an encoder model takes no grammar
        return self.runner.execute_model(so, late_bitmask)

    def shutdown(self) -> None:
        """Stop the KV tiers' I/O thread and release the disk tier's file (its lock)."""
        if self.offload is not None:
            self.offload.shutdown()

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's weights as loaded: parameters and buffers (quantized weights
        at their packed size), not the rotary table, which is derived, not loaded."""
        model = self.loaded.model
        derived = getattr(model, "cos_sin_cache", None)
        tensors = [*model.parameters(), *(b for b in model.buffers() if b is not derived)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _kv_bytes_per_token(self) -> int:
        if not isinstance(self.runner, ModelRunner):
            return 0
        return kv_bytes_per_token(self.loaded.arch, self.runner.kv_cache.dtype, self.tp.world_size)

    def _group_block_bytes(self) -> int:
        """Bytes of one host-tier block over the whole tensor-parallel group (0: no tier)."""
        return 0 if self.offload is None else self.offload.block_bytes * self.tp.world_size

    def facts(self, num_blocks: int, weight_bytes: int | None = None) -> ModelFacts:
        loaded = self.loaded
        return ModelFacts(
            served_model_name=loaded.served_model_name,
            arch=loaded.arch,
            max_model_len=loaded.max_model_len,
            eos_token_ids=tuple(sorted(loaded.eos_token_ids)),
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=str(self.device),
            model_path=str(loaded.model_path),
            tokenizer_path=None if loaded.tokenizer_dir is None else str(loaded.tokenizer_dir),
            num_blocks=num_blocks,
            tensor_parallel_size=self.tp.world_size,
            quantization=getattr(loaded, "quantization", None),
            weight_bytes=self.weight_bytes if weight_bytes is None else weight_bytes,
            kv_bytes_per_token=self._kv_bytes_per_token(),
            embed=loaded.embed,
            encoder=isinstance(loaded, LoadedEncoder),
            num_offload_blocks=0 if self.offload is None else self.offload.num_slots,
            kv_block_bytes=self._group_block_bytes(),
            num_disk_blocks=0 if self.offload is None else self.offload.num_disk_slots,
            disk_entries=() if self.offload is None else tuple(self.offload.disk_entries),
        )
