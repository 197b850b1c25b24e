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

The disk tier (``worker/kv_disk.py``): a step's ``disk_writes`` read their sources (host
slots, device blocks) before its saves and forward, then write on the I/O thread; a load with
disk reads runs whole on that thread (one thread: writes and reads stay in order), and reports
the device blocks whose record failed its checks.

The CUDA path is written but only the CPU path runs in this project's tests.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Sequence

import torch

from tokenwire.kernels.kv_quant import FP8_KV_DTYPE
from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.kv_transfer import DiskWrite, KVLoad, KVTransferPlan
from tokenwire.runtime.worker.kv_cache import KVCache
from tokenwire.runtime.worker.kv_disk import DiskStore, disk_file, layout_fingerprint, record_bytes

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
    config: EngineConfig,
    kv_cache: KVCache,
    device: torch.device,
    model_path: str,
    tp_rank: int = 0,
) -> KVOffloader | None:
    """The host tier's copy engine for ``--kv-offloading-size`` GiB (and the disk tier's file
    for ``--kv-offloading-disk-path``); None when it is off.

    Tensor parallel: the sizes are for the whole group (vLLM's rule), each rank holds its
    share of every block (its KV heads, the same bytes on every rank) in ``1/TP`` of them,
    so every rank has the same number of slots and records; each rank has its own disk file."""
    cache = config.cache
    if not cache.kv_offloading_size or not cache.enable_prefix_caching:
        return None
    ranks = config.parallel.tensor_parallel_size
    per_block = kv_block_bytes(kv_cache) * ranks  # the whole group's bytes of one block
    num_slots = int(cache.kv_offloading_size * (1 << 30)) // per_block
    if num_slots < 1:
        raise ValueError(
            f"--kv-offloading-size {cache.kv_offloading_size} GiB holds no KV block "
            f"({per_block} bytes each): raise it or set 0 to turn the tier off"
        )
    disk = None
    if cache.kv_offloading_disk_path and cache.kv_offloading_disk_size:
        shard_record = record_bytes(per_block // ranks)
        num_records = int(cache.kv_offloading_disk_size * (1 << 30)) // (shard_record * ranks)
        if num_records < 1:
            raise ValueError(
                f"--kv-offloading-disk-size {cache.kv_offloading_disk_size} GiB holds no KV "
                f"block ({shard_record * ranks} bytes each)"
            )
        k = kv_cache.layers[0].k_cache
        model = config.model
        fingerprint = layout_fingerprint(
            model_path, model.revision, model.load_format, model.seed, model.quantization,
            cache.block_size, cache.kv_cache_dtype, str(k.dtype), len(kv_cache.layers),
            tuple(k.shape[1:]),
        )  # fmt: skip
        path = disk_file(
            cache.kv_offloading_disk_path, config.parallel.data_parallel_rank, tp_rank, ranks
        )
        disk = DiskStore(path, num_records, per_block // ranks, fingerprint)
    return KVOffloader(kv_cache, num_slots, device, disk)


class KVOffloader:
    def __init__(
        self,
        kv_cache: KVCache,
        num_slots: int,
        device: torch.device,
        disk: DiskStore | None = None,
    ) -> None:
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
        self.disk = disk
        # Warm restart: the records this model can use, for the scheduler side's index.
        self.disk_entries = [] if disk is None else disk.scan()
        # The I/O thread: CPU loads, and every disk write and disk load (in order).
        self._thread = None if cuda and disk is None else cf.ThreadPoolExecutor(1, "kv-offload")
        self._futures: dict[int, cf.Future[list[int]]] = {}
        self._writes: list[cf.Future[None]] = []
        self._events: dict[int, tuple[torch.cuda.Event, torch.Tensor]] = {}

    @property
    def num_disk_slots(self) -> int:
        return 0 if self.disk is None else self.disk.num_slots

    # ------------------------------------------------------------------ per step
    def start(self, plan: KVTransferPlan) -> None:
        """Read the disk writes' sources, run the saves (done before the forward), then
        queue the disk writes and start the loads."""
        captured = self._capture(plan.disk_writes) if plan.disk_writes else None
        if plan.disk_clear:  # on the I/O thread, before this step's (and later) writes
            assert self._thread is not None and self.disk is not None
            self._writes.append(self._thread.submit(self.disk.invalidate_all))
        loads = plan.loads
        if self._stream is not None:
            self._start_cuda(plan, [x for x in loads if not x.disk])
            loads = [x for x in loads if x.disk]
        elif plan.save_block_ids:
            self._save(plan.save_block_ids, plan.save_slots)
        if not loads and captured is None:
            return
        assert self._thread is not None
        if captured is not None:
            self._writes.append(self._thread.submit(self._write, plan.disk_writes, captured))
        ready = None
        if self._stream is not None:  # the host slots' earlier saves, before the thread reads
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(self._stream)
        for load in loads:
            self._futures[load.load_id] = self._thread.submit(self._load, load, ready)

    def finished(self, wait: bool) -> dict[int, list[int]]:
        """The loads finished since the last call (``wait``: block briefly for one): load id
        -> the device blocks whose disk record failed its checks."""
        for write in [w for w in self._writes if w.done()]:
            self._writes.remove(write)
            write.result()  # a bug in a write fails the step (I/O errors are only logged)
        done = self._finished_cuda(wait) if self._stream is not None else []
        futures = self._futures
        if wait and futures and not done:
            cf.wait(futures.values(), timeout=IDLE_WAIT_S, return_when=cf.FIRST_COMPLETED)
        finished: dict[int, list[int]] = {load_id: [] for load_id in done}
        for load_id in [load_id for load_id, f in futures.items() if f.done()]:
            finished[load_id] = futures.pop(load_id).result()  # a failed copy fails the step
        return finished

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()

    # ------------------------------------------------------------------ CPU copies
    @torch.inference_mode()
    def _save(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        dst = torch.tensor(slots, dtype=torch.int64)
        for i, layer in enumerate(self.kv_cache.layers):
            self.host[:, i, 0].index_copy_(0, dst, _raw(layer.k_cache).index_select(0, ids))
            self.host[:, i, 1].index_copy_(0, dst, _raw(layer.v_cache).index_select(0, ids))

    @torch.inference_mode()
    def _load(self, load: KVLoad, ready: torch.cuda.Event | None) -> list[int]:
        """On the I/O thread: host slots, then disk records, into their device blocks; the
        blocks whose record failed its checks (left unwritten)."""
        if ready is not None:
            ready.synchronize()  # type: ignore[no-untyped-call]
        if load.slots:
            src = self.host.index_select(0, torch.tensor(load.slots, dtype=torch.int64))
            self._write_blocks(load.block_ids, src)
        failed: list[int] = []
        ids: list[int] = []
        rows: list[bytes] = []
        assert self.disk is not None or not load.disk
        for read in load.disk:
            payload = self.disk.read(read.slot, read.block_hash) if self.disk else None
            if payload is None:
                failed.append(read.block_id)
            else:
                ids.append(read.block_id)
                rows.append(payload)
        if rows:
            flat = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8)
            self._write_blocks(
                ids, flat.view(self.host.dtype).view(len(rows), *self.host.shape[1:])
            )
        return failed

    def _write_blocks(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """Copy ``src`` (``[n, layers, 2, ...]`` on the host) into device blocks."""
        stream = self._stream
        if stream is not None:  # on the I/O thread: the side stream, then wait for it
            with torch.cuda.stream(stream):
                self._write_blocks_now(block_ids, src.to(self.device))
            stream.synchronize()  # type: ignore[no-untyped-call]
            return
        self._write_blocks_now(block_ids, src)

    def _write_blocks_now(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        ids = torch.tensor(block_ids, dtype=torch.int64, device=src.device)
        for i, layer in enumerate(self.kv_cache.layers):
            _raw(layer.k_cache).index_copy_(0, ids, src[:, i, 0])
            _raw(layer.v_cache).index_copy_(0, ids, src[:, i, 1])

    # ------------------------------------------------------------------ disk writes
    @torch.inference_mode()
    def _capture(self, writes: Sequence[DiskWrite]) -> torch.Tensor:
        """The writes' bytes, ``[n, layers, 2, ...]`` on the host, read before this step's
        saves (a host source is the victim slot a save is about to overwrite) and forward."""
        if self._stream is not None:
            self._stream.synchronize()  # type: ignore[no-untyped-call]  # earlier saves landed
        rows = torch.empty((len(writes), *self.host.shape[1:]), dtype=self.host.dtype)
        from_host = [j for j, w in enumerate(writes) if w.host_slot >= 0]
        if from_host:
            slots = torch.tensor([writes[j].host_slot for j in from_host], dtype=torch.int64)
            rows[from_host] = self.host.index_select(0, slots)
        from_device = [j for j, w in enumerate(writes) if w.host_slot < 0]
        if from_device:
            ids = [writes[j].block_id for j in from_device]
            index = torch.tensor(ids, dtype=torch.int64, device=self.device)
            layers = [
                torch.stack([_raw(x.k_cache)[index], _raw(x.v_cache)[index]], 1)
                for x in self.kv_cache.layers
            ]
            rows[from_device] = torch.stack(layers, 1).cpu()
        return rows

    def _write(self, writes: Sequence[DiskWrite], rows: torch.Tensor) -> None:
        assert self.disk is not None
        raw = rows.view(torch.uint8).reshape(len(writes), -1).numpy()
        for write, row in zip(writes, raw, strict=True):
            self.disk.write(write.slot, write.block_hash, row.data)

    # ------------------------------------------------------------------ CUDA copies
    @torch.inference_mode()
    def _start_cuda(self, plan: KVTransferPlan, loads: Sequence[KVLoad]) -> None:
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
            for load in loads:
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
