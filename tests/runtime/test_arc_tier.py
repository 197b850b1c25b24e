"""The ARC slot index of the KV tiers (``core/arc_tier.py``): the contract it shares with the
LRU ``HostTier`` (slots, pins, ``can_take``, restore, clear) under random operations, and what
ARC is for — a scan of blocks used once leaves the reused blocks resident, where LRU flushes
them — plus the adaptation of its target after ghost hits."""

from __future__ import annotations

import random

import pytest

from tokenwire.runtime.core.arc_tier import ArcTier
from tokenwire.runtime.core.host_tier import HostTier
from tokenwire.runtime.core.tier_index import EVICTION_POLICIES, TierIndex, new_tier_index


def h(i: int) -> bytes:
    return i.to_bytes(8, "little")


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_random_operations_keep_the_shared_contract(policy: str) -> None:
    rng = random.Random(7)
    tier = new_tier_index(6, policy)  # type: ignore[arg-type]
    pinned: list[int] = []
    held: dict[bytes, int] = {}  # what the tier must still hold: the pinned hashes
    for _ in range(3000):
        op = rng.random()
        key = h(rng.randrange(20))
        if op < 0.45:
            before = tier.peek(key)
            slot, victim = tier.put_evicting(key)
            if before is not None:
                assert (slot, victim) == (None, None) and tier.peek(key) == before
            elif slot is None:  # dropped: every resident slot was pinned
                assert len(tier) == tier.num_slots and tier.num_pinned == tier.num_slots
            else:
                assert tier.peek(key) == slot and slot not in pinned
                assert victim is None or (victim not in tier and victim not in held)
        elif op < 0.65:
            slot = tier.get(key)
            assert slot == tier.peek(key)
        elif op < 0.75 and key in tier and rng.random() < 0.5:
            slot = tier.peek(key)
            assert slot is not None
            tier.pin([slot])
            pinned.append(slot)
            held[key] = slot
        elif op < 0.85 and pinned:
            slot = pinned.pop(rng.randrange(len(pinned)))
            tier.unpin([slot])
            if slot not in pinned:
                held = {k: s for k, s in held.items() if s != slot}
        elif op < 0.9:
            was_here = key in tier
            assert tier.remove(key) == (was_here and key not in held)
            assert key not in tier or key in held
        for key_held, slot_held in held.items():  # a pinned slot keeps its hash
            assert tier.peek(key_held) == slot_held
        tier.check_invariants()
    for slot in pinned:
        tier.unpin([slot])
    tier.check_invariants(idle=True)
    assert tier.clear() and len(tier) == 0


def test_a_scan_of_once_used_blocks_leaves_the_reused_ones() -> None:
    """Four blocks each used twice (a shared prefix), then a scan of 20 blocks used once: ARC
    keeps the four, LRU loses every one of them (the test can fail)."""
    tiers: dict[str, TierIndex] = {"lru": HostTier(8), "arc": ArcTier(8)}
    for tier in tiers.values():
        for i in range(4):
            tier.put(h(i))
        assert tier.lookup_run([h(i) for i in range(4)]) == [0, 1, 2, 3]
        for i in range(100, 120):
            tier.put(h(i))
        tier.check_invariants()
    assert [h(i) in tiers["arc"] for i in range(4)] == [True] * 4
    assert [h(i) in tiers["lru"] for i in range(4)] == [False] * 4
    assert tiers["arc"].lookup_run([h(i) for i in range(4)]) == [0, 1, 2, 3]


def test_ghost_hits_move_the_target() -> None:
    tier = ArcTier(4)
    for i in range(4):
        tier.put(h(i))
    tier.get(h(0))  # h0 reused: T2
    for i in range(4, 7):
        tier.put(h(i))  # T1 over its target (0): h1, h2, h3 evicted; |T1| + |B1| <= 4 keeps h3
    assert tier.target == 0 and all(h(i) not in tier for i in (1, 2, 3))
    tier.put(h(3))  # a B1 ghost: recency wanted more room, and h3 comes back as reused
    assert tier.target == 1 and tier.peek(h(3)) is not None and tier.recent_size == 2
    tier.check_invariants()
    tier.get(h(5))
    tier.get(h(6))  # T2 = h0 h3 h5 h6; the next misses evict T2's LRU (h0, h3) into B2
    assert tier.recent_size == 0
    tier.put(h(8))
    tier.put(h(9))
    assert h(0) not in tier and h(3) not in tier
    tier.put(h(0))  # a B2 ghost: frequency wanted more room
    assert tier.target == 0 and tier.peek(h(0)) is not None
    tier.check_invariants()


def test_pins_redirect_the_victim_and_a_full_pin_drops_the_save() -> None:
    tier = ArcTier(3)
    for i in range(3):
        tier.put(h(i))
    tier.get(h(2))  # T1 = h0 h1, T2 = h2
    tier.pin([tier.peek(h(0)), tier.peek(h(1))])  # type: ignore[list-item]
    slot, victim = tier.put_evicting(h(3))  # T1's slots are pinned: T2 gives one
    assert victim == h(2) and slot == 2
    tier.pin([slot])
    assert tier.put_evicting(h(4)) == (None, None)  # everything pinned: dropped
    assert not tier.can_take([h(4)]) and tier.can_take([h(0), h(3)])
    assert not tier.remove(h(0)) and not tier.clear()
    tier.unpin([0, 1, 2])
    tier.check_invariants(idle=True)
    assert tier.remove(h(0)) and h(0) not in tier
    assert tier.clear() and len(tier) == 0
    tier.check_invariants(idle=True)


def test_restore_takes_the_records_as_once_used() -> None:
    tier = ArcTier(4)
    tier.restore([(h(1), 3), (h(2), 0)])
    assert tier.peek(h(1)) == 3 and tier.recent_size == 2
    assert tier.put(h(3)) == 1  # the lowest free slot
    tier.check_invariants()


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="eviction policy"):
        new_tier_index(4, "fifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one block"):
        ArcTier(0)
