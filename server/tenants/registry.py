"""Key -> tenant, the limit checks before admission, and concurrency accounting.

One ``TenantRegistry`` per server, used on the event loop only (gRPC handlers, the REST shim's
loopback calls and the SIGHUP handler all run there), so its counters need no lock. Usage
(buckets, in-flight requests, open sessions) is kept per tenant *name* and survives a reload:
a reload changes the limits, never the accounting, and an in-flight request keeps the tenant
and the lease it was admitted with.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass

from tokenwire.server.telemetry.logs import get_logger
from tokenwire.server.tenants.buckets import Clock
from tokenwire.server.tenants.config import (
    ANONYMOUS_TENANT,
    DEFAULT_TENANT,
    Tenant,
    TenantConfig,
    TenantConfigError,
    key_digest,
    load_tenant_file,
)
from tokenwire.server.tenants.limits import Lease, LimitExceeded, TenantUsage

logger = get_logger("tokenwire.tenants")


@dataclass(frozen=True)
class Caller:
    """Who sent a call: its tenant (as admitted) and its request-id namespace."""

    tenant: Tenant
    usage: TenantUsage
    namespace: str  # request ids live in the engine as ``<namespace>/<request_id>``

    @property
    def name(self) -> str:
        return self.tenant.name

    def cache_salt(self, requested: str | None) -> str | None:
        """The salt of this caller's prefix-cache blocks. An isolated tenant's salt starts with
        its name; a sharing tenant's requested salt is set apart from every tenant's, so no
        client can pick a salt that reaches another tenant's blocks."""
        if not self.tenant.share_prefix_cache:
            suffix = f"|{requested}" if requested else ""
            return f"tenant:{self.tenant.name}{suffix}"
        return f"shared:{requested}" if requested else None


def merged_config(api_keys: tuple[str, ...], config: TenantConfig | None) -> TenantConfig:
    """``--api-key`` keys as the tenant "default" (no limits, shares the prefix cache), merged
    with the key file's tenants; a key or the name "default" in both is an error."""
    tenants = list(config.tenants) if config is not None else []
    if api_keys:
        digests = tuple(key_digest(k) for k in api_keys)
        for tenant in tenants:
            if tenant.name == DEFAULT_TENANT:
                raise TenantConfigError(
                    f"--api-key-file: tenant {DEFAULT_TENANT!r} is the tenant of --api-key "
                    "keys; rename it or drop --api-key"
                )
            if set(digests) & set(tenant.key_digests):
                raise TenantConfigError(
                    f"--api-key: a key is also a key of tenant {tenant.name!r} in --api-key-file"
                )
        tenants.append(Tenant(DEFAULT_TENANT, digests, share_prefix_cache=True))
    return TenantConfig(tuple(tenants), config.path if config is not None else None)


class TenantRegistry:
    def __init__(
        self,
        config: TenantConfig | None = None,
        api_keys: tuple[str, ...] = (),
        clock: Clock = time.monotonic,
    ) -> None:
        self._clock = clock
        self._api_keys = api_keys
        self._api_digests = tuple(key_digest(k) for k in api_keys)
        self._usage: dict[str, TenantUsage] = {}
        anonymous = Tenant(ANONYMOUS_TENANT, (), share_prefix_cache=True)
        self._anonymous = Caller(anonymous, TenantUsage(anonymous, clock), "anon")
        self._install(merged_config(api_keys, config))

    def _install(self, config: TenantConfig) -> None:
        self.config = config
        self._keys = tuple((d, t) for t in config.tenants for d in t.key_digests)
        for tenant in config.tenants:
            usage = self._usage.get(tenant.name)
            if usage is None:
                self._usage[tenant.name] = TenantUsage(tenant, self._clock)
            else:
                usage.configure(tenant)

    @property
    def auth_required(self) -> bool:
        return bool(self.config.tenants)

    @property
    def names(self) -> tuple[str, ...]:
        """Every tenant name this registry has served: a bounded metric label set."""
        return (ANONYMOUS_TENANT, *sorted(self._usage))

    def _tenant_of(self, token: str) -> Tenant | None:
        """Constant-time over every key: the time does not depend on which key matched."""
        candidate = key_digest(token)
        found = None
        for digest, tenant in self._keys:
            if hmac.compare_digest(candidate, digest):
                found = tenant
        return found

    def _api_key_index(self, token: str) -> int:
        """The position of ``token`` among the ``--api-key`` keys (constant-time)."""
        candidate, found = key_digest(token), -1
        for i, digest in enumerate(self._api_digests):
            if hmac.compare_digest(candidate, digest):
                found = i
        return found

    def is_valid(self, token: str | None) -> bool:
        return token is not None and self._tenant_of(token) is not None

    def identify(self, token: str | None) -> Caller | None:
        """The caller of a bearer token; the anonymous caller on a server without keys, None
        for an unknown or missing key on a server with keys."""
        if not self.auth_required:
            return self._anonymous
        tenant = None if token is None else self._tenant_of(token)
        if tenant is None:
            return None
        assert token is not None
        if tenant.name == DEFAULT_TENANT:  # --api-key: ids scoped per key, as before tenants
            # The key's position, never anything derived from the key: engine request ids
            # reach spans and log lines, and a hash prefix there is key material.
            namespace = f"api-key-{self._api_key_index(token)}"
        else:
            namespace = f"tenant:{tenant.name}"
        return Caller(tenant, self._usage[tenant.name], namespace)

    def admit(self, caller: Caller) -> Lease:
        """Check the caller's limits and take a request slot, or raise ``LimitExceeded``."""
        return caller.usage.admit_request()

    def open_session(self, caller: Caller) -> Lease:
        return caller.usage.open_session()

    def reload(self) -> bool:
        """Re-read the key file (SIGHUP). A bad file keeps the old tenants and logs why."""
        path = self.config.path
        if path is None:
            return False
        try:
            config = merged_config(self._api_keys, load_tenant_file(path))
        except TenantConfigError as exc:
            logger.error("tenant key file reload failed; keeping the old tenants", error=str(exc))
            return False
        self._install(config)
        logger.info("tenant key file reloaded", path=path, tenants=[t.name for t in config.tenants])
        return True


__all__ = ["Caller", "Lease", "LimitExceeded", "TenantRegistry", "merged_config"]
