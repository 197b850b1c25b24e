"""Token buckets on a monotonic clock (injectable, so tests drive time themselves).

A bucket holds up to ``capacity`` tokens and refills at ``rate`` tokens per second. Requests
``try_take`` one token (refused ones take nothing); generated tokens are ``charge``d as they
are produced and may drive the level below zero (a debt the refill pays back first).
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]


class TokenBucket:
    def __init__(self, rate: float, capacity: float, clock: Clock = time.monotonic) -> None:
        if rate <= 0 or capacity <= 0:
            raise ValueError("a token bucket needs a positive rate and capacity")
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._level = capacity  # starts full
        self._stamp = clock()

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._stamp)
        self._level = min(self.capacity, self._level + elapsed * self.rate)
        self._stamp = now

    @property
    def level(self) -> float:
        self._refill()
        return self._level

    def wait_time(self, amount: float = 1.0) -> float:
        """Seconds until the bucket holds ``amount`` tokens (0.0: it does now)."""
        level = self.level
        return 0.0 if level >= amount else (amount - level) / self.rate

    def try_take(self, amount: float = 1.0) -> float:
        """Take ``amount`` tokens and return 0.0, or take nothing and return the wait."""
        wait = self.wait_time(amount)
        if wait == 0.0:
            self._level -= amount
        return wait

    def charge(self, amount: float) -> None:
        """Take ``amount`` unconditionally (the level may go negative)."""
        self._refill()
        self._level -= amount

    def reconfigure(self, rate: float, capacity: float) -> None:
        """New limits (a reload): the level so far carries over, clipped to the capacity, so a
        reload neither refills the bucket nor forgives a debt."""
        if rate <= 0 or capacity <= 0:
            raise ValueError("a token bucket needs a positive rate and capacity")
        self._refill()
        self.rate, self.capacity = rate, capacity
        self._level = min(self._level, capacity)
