"""One block table of the ``KVCacheManager`` (``RequestBlocks``: a request's, or a Session's
held between its turns) and the consistency check of all of them (``check_tables``)."""

from __future__ import annotations

from collections.abc import Iterable

from tokenwire.runtime.core.block_pool import KVBlock


class RequestBlocks:
    """What the manager keeps for one request, keyed by its ``request_id``."""

    __slots__ = ("block_hashes", "block_ids", "blocks", "num_cached_blocks", "num_skipped")

    def __init__(self) -> None:
        self.blocks: list[KVBlock] = []
        self.block_ids: list[int] = []  # same order as ``blocks``: the block_table row
        # Hashes of the request's full blocks computed so far (may run ahead of ``blocks``).
        self.block_hashes: list[bytes] = []
        # Leading table blocks already offered to the prefix cache (cached, or skipped as
        # duplicates of a block another request cached first).
        self.num_cached_blocks = 0
        # Leading table entries freed as out of every layer's window (now the null block).
        self.num_skipped = 0

    def owned(self) -> list[KVBlock]:
        """The blocks this table holds a reference on (skipped entries excluded)."""
        return self.blocks[self.num_skipped :]


def check_tables(tables: Iterable[tuple[str, RequestBlocks]], null_id: int) -> dict[int, int]:
    """Raise AssertionError unless each table agrees with itself (ids, skipped entries,
    cached hashes); the references the tables hold, per block id."""
    ref_cnts: dict[int, int] = {}
    for request_id, state in tables:
        check([b.block_id for b in state.blocks] == state.block_ids, f"{request_id}: mismatch")
        skipped, ids = (
            state.block_ids[: state.num_skipped],
            state.block_ids[state.num_skipped :],
        )
        check(all(i == null_id for i in skipped), f"{request_id}: skipped entry not null")
        check(len(set(ids)) == len(ids), f"{request_id}: block twice in a table {ids}")
        num_entries = len(state.block_ids)
        check(state.num_cached_blocks <= num_entries, f"{request_id}: cached past the table")
        for i in range(state.num_cached_blocks):
            block_hash = state.blocks[i].block_hash
            check(
                block_hash is None or block_hash == state.block_hashes[i],
                f"{request_id}: block {state.block_ids[i]} at position {i} caches other tokens",
            )
        for block_id in ids:
            ref_cnts[block_id] = ref_cnts.get(block_id, 0) + 1
    return ref_cnts


def check(condition: bool, message: str) -> None:
    # Explicit raise instead of ``assert`` so the checks survive ``python -O``.
    if not condition:
        raise AssertionError(message)
