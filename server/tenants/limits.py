"""One tenant's usage: request and token buckets, in-flight requests, open sessions.

``admit_request`` checks every limit before it takes anything, so a refused request costs the
tenant nothing. Generated tokens are charged to the lease as they are produced (each streamed
delta); a request already running finishes even when that empties the bucket, and the next
one is refused until the refill has paid the debt back.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.runtime.errors import clip
from tokenwire.server.tenants.buckets import Clock, TokenBucket
from tokenwire.server.tenants.config import Tenant

CONCURRENCY_RETRY_S = 1.0  # no clock says when a slot frees up: a hint, like QUEUE_FULL's
SESSION_RETRY_S = 5.0


class LimitExceeded(Exception):
    """A tenant's limit refused a request; the message names the tenant and the limit."""

    def __init__(self, tenant: str, limit: str, value: float, retry_after: float) -> None:
        shown = int(value) if float(value).is_integer() else value
        super().__init__(f"tenant {tenant!r} exceeded {limit}={shown}")
        self.tenant = tenant
        self.limit = limit
        self.retry_after = retry_after


class ModelNotAllowed(Exception):
    def __init__(self, tenant: str, model: str) -> None:
        super().__init__(f"tenant {tenant!r} may not use model {clip(model)!r}")
        self.tenant = tenant
        self.model = model


def _bucket(current: TokenBucket | None, rate: float, capacity: float, clock: Clock) -> TokenBucket:
    if current is None:
        return TokenBucket(rate, capacity, clock)
    current.reconfigure(rate, capacity)
    return current


class TenantUsage:
    def __init__(self, tenant: Tenant, clock: Clock) -> None:
        self._clock = clock
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.in_flight = 0
        self.sessions = 0
        self.configure(tenant)

    def configure(self, tenant: Tenant) -> None:
        """(Re)apply the tenant's limits; counts and bucket levels carry over."""
        self.tenant = tenant
        limits, clock = tenant.limits, self._clock
        rps, tpm = limits.requests_per_second, limits.tokens_per_minute
        burst = limits.request_burst
        self.requests = None if rps is None else _bucket(self.requests, rps, burst, clock)
        self.tokens = None if tpm is None else _bucket(self.tokens, tpm / 60.0, tpm, clock)

    def admit_request(self) -> Lease:
        name, limits = self.tenant.name, self.tenant.limits
        cap = limits.max_concurrent_requests
        if cap is not None and self.in_flight >= cap:
            raise LimitExceeded(name, "max_concurrent_requests", cap, CONCURRENCY_RETRY_S)
        if self.tokens is not None and self.tokens.level <= 0:
            assert limits.tokens_per_minute is not None
            wait = self.tokens.wait_time(1.0)
            raise LimitExceeded(name, "tokens_per_minute", limits.tokens_per_minute, wait)
        if self.requests is not None:
            wait = self.requests.try_take()
            if wait > 0:
                assert limits.requests_per_second is not None
                raise LimitExceeded(name, "requests_per_second", limits.requests_per_second, wait)
        self.in_flight += 1
        return Lease(self, "request")

    def open_session(self) -> Lease:
        cap = self.tenant.limits.max_sessions
        if cap is not None and self.sessions >= cap:
            raise LimitExceeded(self.tenant.name, "max_sessions", cap, SESSION_RETRY_S)
        self.sessions += 1
        return Lease(self, "session")


@dataclass
class Lease:
    """A request slot or a session slot, released exactly once."""

    usage: TenantUsage
    kind: str  # "request" | "session"
    released: bool = False

    def charge(self, tokens: int) -> None:
        """Generated tokens, as they are produced."""
        if tokens > 0 and self.usage.tokens is not None:
            self.usage.tokens.charge(tokens)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self.kind == "request":
            self.usage.in_flight -= 1
        else:
            self.usage.sessions -= 1
