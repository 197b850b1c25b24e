"""The worker-side part of the KV connector: copies device KV blocks to and from the host
tier's buffer (``--kv-offloading-size``; docs/kv-tiers.md).

The buffer is ``[num_slots, num_layers, 2, block_size, num_kv_heads, head_dim]`` in the KV
cache's storage dtype (fp8 caches move their bytes as they are, as a uint8 view; their
per-layer scales are constants and do not move), pinned on CUDA. Per step
(``KVTransferPlan``, the order the scheduler relies on):

1. **Saves** (device -> host) finish before this step's forward, which may overwrite the
   blocks they read: on CPU they run inline; on CUDA on the side stream, and the compute
   stream waits for them (an event) before the forward.
2. **Loads** (host -> device) start after the saves, off the critical path: on CPU on one
   worker thread, on CUDA on the side stream with an event per load. The blocks they write
   belong to no request table, so the forward running meanwhile never reads them.
3. After the forward, finished loads are reported (``ModelOutput.kv_loads_done``); a step
   with nothing to compute waits briefly for one instead of spinning.

The CUDA path is written but only the CPU path runs in this project's tests.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Sequence

import torch

from tokenwire.kernels.kv_quant import FP8_KV_DTYPE
from tokenwire.runtime.config import CacheConfig
from tokenwire.runtime.kv_transfer import KVTransferPlan
from tokenwire.runtime.worker.kv_cache import KVCache

# A step with nothing to compute waits at most this long for a load to finish.
IDLE_WAIT_S = 0.01


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as the copy kernels take them: fp8 has no CPU index_copy, so an fp8
    cache moves as a uint8 view (same element size, the bytes unchanged)."""
    return cache.view(torch.uint8) if cache.dtype == FP8_KV_DTYPE else cache


def kv_block_bytes(kv_cache: KVCache) -> int:
    """Bytes of one KV block over all layers, K and V (what one host slot holds)."""
    k = kv_cache.layers[0].k_cache
    return 2 * len(kv_cache.layers) * k[0].numel() * k.element_size()


def make_offloader(
    cache: CacheConfig, kv_cache: KVCache, device: torch.device
) -> KVOffloader | None:
    """The host tier's copy engine for ``--kv-offloading-size`` GiB; None when it is off."""
    if not cache.kv_offloading_size or not cache.enable_prefix_caching:
        return None
    per_block = kv_block_bytes(kv_cache)
    num_slots = int(cache.kv_offloading_size * (1 << 30)) // per_block
    if num_slots < 1:
        raise ValueError(
            f"--kv-offloading-size {cache.kv_offloading_size} GiB holds no KV block "
            f"({per_block} bytes each): raise it or set 0 to turn the tier off"
        )
    return KVOffloader(kv_cache, num_slots, device)


class KVOffloader:
    def __init__(self, kv_cache: KVCache, num_slots: int, device: torch.device) -> None:
        self.kv_cache = kv_cache
        self.num_slots = num_slots
        self.device = device
        self.block_bytes = kv_block_bytes(kv_cache)
        k = kv_cache.layers[0].k_cache
        shape = (num_slots, len(kv_cache.layers), 2, *k.shape[1:])
        cuda = device.type == "cuda"
        # Never read before a save writes it: no need to zero (or touch) the pages.
        self.host = torch.empty(shape, dtype=_raw(k).dtype, pin_memory=cuda)
        self._stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
        self._thread = None if cuda else cf.ThreadPoolExecutor(1, "kv-offload")
        self._futures: dict[int, cf.Future[None]] = {}
        self._events: dict[int, tuple[torch.cuda.Event, torch.Tensor]] = {}

    # ------------------------------------------------------------------ per step
    def start(self, plan: KVTransferPlan) -> None:
        """Run the saves (done before the forward) and start the loads."""
        if self._stream is not None:
            self._start_cuda(plan)
            return
        if plan.save_block_ids:
            self._save(plan.save_block_ids, plan.save_slots)
        assert self._thread is not None
        for load in plan.loads:
            self._futures[load.load_id] = self._thread.submit(
                self._load, load.slots, load.block_ids
            )

    def finished(self, wait: bool) -> list[int]:
        """Ids of the loads finished since the last call (``wait``: block briefly for one)."""
        if self._stream is not None:
            return self._finished_cuda(wait)
        futures = self._futures
        if wait and futures:
            cf.wait(futures.values(), timeout=IDLE_WAIT_S, return_when=cf.FIRST_COMPLETED)
        done = [load_id for load_id, f in futures.items() if f.done()]
        for load_id in done:
            futures.pop(load_id).result()  # a failed copy fails the step
        return done

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    # ------------------------------------------------------------------ CPU copies
    @torch.inference_mode()
    def _save(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        dst = torch.tensor(slots, dtype=torch.int64)
        for i, layer in enumerate(self.kv_cache.layers):
            self.host[:, i, 0].index_copy_(0, dst, _raw(layer.k_cache).index_select(0, ids))
            self.host[:, i, 1].index_copy_(0, dst, _raw(layer.v_cache).index_select(0, ids))

    @torch.inference_mode()
    def _load(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.int64)
        src = self.host.index_select(0, torch.tensor(slots, dtype=torch.int64))
        for i, layer in enumerate(self.kv_cache.layers):
            _raw(layer.k_cache).index_copy_(0, ids, src[:, i, 0])
            _raw(layer.v_cache).index_copy_(0, ids, src[:, i, 1])

    # ------------------------------------------------------------------ CUDA copies
    @torch.inference_mode()
    def _start_cuda(self, plan: KVTransferPlan) -> None:
        stream = self._stream
        assert stream is not None
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)  # after every earlier step's writes
        with torch.cuda.stream(stream):
            if plan.save_block_ids:
                ids = torch.tensor(plan.save_block_ids, dtype=torch.int64, device=self.device)
                gathered = torch.stack(
                    [
                        torch.stack([_raw(x.k_cache)[ids], _raw(x.v_cache)[ids]], 1)
                        for x in self.kv_cache.layers
                    ],
                    1,
                )
                for j, slot in enumerate(plan.save_slots):
                    self.host[slot].copy_(gathered[j], non_blocking=True)
                saved = torch.cuda.Event()  # type: ignore[no-untyped-call]
                saved.record(stream)
                compute.wait_event(saved)  # the forward may overwrite the saved blocks
            for load in plan.loads:
                staging = torch.empty(
                    (len(load.slots), *self.host.shape[1:]),
                    dtype=self.host.dtype,
                    device=self.device,
                )
                for j, slot in enumerate(load.slots):
                    staging[j].copy_(self.host[slot], non_blocking=True)
                ids = torch.tensor(load.block_ids, dtype=torch.int64, device=self.device)
                for i, layer in enumerate(self.kv_cache.layers):
                    _raw(layer.k_cache).index_copy_(0, ids, staging[:, i, 0])
                    _raw(layer.v_cache).index_copy_(0, ids, staging[:, i, 1])
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                self._events[load.load_id] = (event, staging)

    def _finished_cuda(self, wait: bool) -> list[int]:
        events = self._events
        if wait and events and not any(e.query() for e, _ in events.values()):  # type: ignore[no-untyped-call]
            next(iter(events.values()))[0].synchronize()
        done = [load_id for load_id, (event, _) in events.items() if event.query()]  # type: ignore[no-untyped-call]
        for load_id in done:
            del events[load_id]
        return done
