"""What the scheduler asks of a KV connector (its scheduler-side part): the only hooks it
calls (docs/kv-tiers.md), so another store can plug in without touching the scheduler.
``core/kv_connector.py`` holds the first implementation (the host tier)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenwire.runtime.core.block_pool import KVBlock
from tokenwire.runtime.core.request import Request
from tokenwire.runtime.kv_transfer import KVTransferPlan
from tokenwire.runtime.stats import KVOffloadStats


class KVConnector(Protocol):
    """What the scheduler asks of a KV connector (scheduler side)."""

    @property
    def has_pending(self) -> bool:
        """Loads in flight (the engine must keep stepping until they are acknowledged)."""
        ...

    def on_evict(self, block: KVBlock) -> None: ...

    def hold_session(self, holder_id: str, blocks: Sequence[tuple[KVBlock, bytes]]) -> bool: ...

    def unhold_session(self, holder_id: str) -> bool: ...

    def waiting_for_load(self, request_id: str) -> bool: ...

    def start_load(
        self, request: Request, block_hashes: Sequence[bytes], hit_ids: Sequence[int]
    ) -> bool:
        """Schedule loads continuing a device prefix hit; True: the request must wait."""
        ...

    def admitted(self, request_id: str) -> None: ...

    def release_ready(self, keep: str) -> bool: ...

    def request_finished(self, request_id: str) -> None: ...

    def build_plan(self) -> KVTransferPlan | None: ...

    def loads_done(self, load_ids: Sequence[int], failed: Sequence[int] = ()) -> None: ...

    def block_refs(self) -> dict[int, int]: ...

    def stats(self) -> KVOffloadStats: ...

    def reset(self) -> bool: ...

    def check_invariants(self, idle: bool = False) -> None: ...
