"""``DPBalancer``: which data-parallel engine core a request goes to (plain bookkeeping, no
I/O; ``DPCoreClient`` drives it from the front's event loop).

Rules, in order:
1. **Session affinity.** A request that continues a holder (a Session's or a stored Responses
   chain's held KV: ``hold_as``) goes to the core that holds it, always: its blocks live there.
2. **Prefix affinity.** Each prompt's full blocks are hashed as a chain (with its cache salt
   and LoRA adapter, like the prefix cache's keys); a bounded LRU remembers the core each chain
   hash was last sent to. The core of the longest remembered prefix wins while its load is at
   most the least loaded core's plus ``slack`` requests.
3. **Load.** Otherwise the core with the fewest requests in flight (sent and not finished),
   then the fewest waiting in its last snapshot, then the lowest rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

AFFINITY_ENTRIES = 1 << 16  # chain hashes remembered (~5 MiB at most)
AFFINITY_SLACK = 4  # requests a preferred core may carry above the least loaded one


class DPBalancer:
    def __init__(
        self,
        ranks: int,
        block_size: int,
        affinity_entries: int = AFFINITY_ENTRIES,
        slack: int = AFFINITY_SLACK,
    ) -> None:
        if ranks < 1 or block_size < 1 or affinity_entries < 1 or slack < 0:
            raise ValueError("ranks, block_size and affinity_entries must be >= 1, slack >= 0")
        self.ranks = ranks
        self.block_size = block_size
        self.affinity_entries = affinity_entries
        self.slack = slack
        self._rank_of: dict[str, int] = {}  # engine-side request id -> its core
        self._parent_of: dict[str, str] = {}  # engine-side request id -> the front's request
        self._children: dict[str, set[str]] = {}  # the front's request -> its unfinished ids
        self._in_flight = [0] * ranks
        self._waiting = [0] * ranks  # from each core's last snapshot
        self._holders: dict[str, int] = {}  # holder id -> the core holding its blocks
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # chain hash -> core
        self.assigned = [0] * ranks  # requests ever sent to each core (a counter)

    # ------------------------------------------------------------------ choosing
    def choose(
        self,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        holder: str | None = None,
    ) -> int:
        """The core for a new request (nothing is recorded until ``assign``)."""
        if holder is not None and holder in self._holders:
            return self._holders[holder]
        least = self._least_loaded()
        preferred = self._longest_prefix(self._chain(prompt_token_ids, cache_salt, lora_name))
        slack = self._in_flight[least] + self.slack
        if preferred is not None and self._in_flight[preferred] <= slack:
            return preferred
        return least

    def assign(
        self,
        rank: int,
        parent_id: str,
        request_ids: Iterable[str],
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        holder: str | None = None,
    ) -> None:
        """Record that these requests (one prompt's choices) were sent to ``rank``."""
        children = self._children.setdefault(parent_id, set())
        for request_id in request_ids:
            self._rank_of[request_id] = rank
            self._parent_of[request_id] = parent_id
            children.add(request_id)
            self._in_flight[rank] += 1
        self.assigned[rank] += 1
        if holder is not None:
            self._holders[holder] = rank
        for chain_hash in self._chain(prompt_token_ids, cache_salt, lora_name):
            self._prefixes[chain_hash] = rank
            self._prefixes.move_to_end(chain_hash)
        while len(self._prefixes) > self.affinity_entries:
            self._prefixes.popitem(last=False)

    # ------------------------------------------------------------------ what happened
    def rank_of(self, request_id: str) -> int | None:
        return self._rank_of.get(request_id)

    def finished(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed); unknown ids are ignored."""
        rank = self._rank_of.pop(request_id, None)
        if rank is None:
            return
        self._in_flight[rank] -= 1
        parent = self._parent_of.pop(request_id)
        children = self._children[parent]
        children.discard(request_id)
        if not children:
            del self._children[parent]

    def failed(self, parent_id: str) -> None:
        """Adding the front's request failed in its core: none of its choices runs."""
        for request_id in list(self._children.get(parent_id, ())):
            self.finished(request_id)

    def tracked(self) -> int:
        """Requests in flight as the balancer knows them (every map stays this size)."""
        assert len(self._rank_of) == len(self._parent_of) == sum(self._in_flight)
        return len(self._rank_of)

    def holder_rank(self, holder: str) -> int | None:
        return self._holders.get(holder)

    def release_holder(self, holder: str) -> int | None:
        """Forget a holder (released or evicted); the core that held it, if known."""
        return self._holders.pop(holder, None)

    def observe_waiting(self, rank: int, num_waiting: int) -> None:
        self._waiting[rank] = num_waiting

    def in_flight(self) -> list[int]:
        return list(self._in_flight)

    # ------------------------------------------------------------------ internals
    def _least_loaded(self) -> int:
        return min(range(self.ranks), key=lambda r: (self._in_flight[r], self._waiting[r], r))

    def _chain(
        self, tokens: Sequence[int], cache_salt: str | None, lora_name: str | None
    ) -> list[int]:
        """One hash per full block, each covering every block before it."""
        size = self.block_size
        parent = hash((cache_salt, lora_name))
        chain = []
        for start in range(0, len(tokens) - size + 1, size):
            parent = hash((parent, tuple(tokens[start : start + size])))
            chain.append(parent)
        return chain

    def _longest_prefix(self, chain: list[int]) -> int | None:
        for chain_hash in reversed(chain):
            rank = self._prefixes.get(chain_hash)
            if rank is not None:
                return rank
        return None
