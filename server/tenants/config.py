"""The ``--api-key-file``: tenants, their keys (stored as hashes), models, priority and limits.

YAML (``.yaml`` / ``.yml``) or TOML (``.toml``), chosen by the extension::

    tenants:
      - name: team-a
        keys: ["sha256:5e88..."]        # tokenwire hash-key KEY; "plain:KEY" only if marked
        models: ["tiny", "sql-lora"]     # served model / LoRA adapter names (default: all)
        max_priority: 0                  # x-priority values below this are raised to it
        share_prefix_cache: false        # default: this tenant's prefix cache is its own
        limits:
          requests_per_second: 5
          burst: 10                      # default: requests_per_second, at least 1
          tokens_per_minute: 20000       # generated tokens
          max_concurrent_requests: 4
          max_sessions: 2

Every error names the file and the field (``tenants[1].limits.burst: must be ...``). No
field is ever silently ignored: an unknown one is an error (a misspelt limit is no limit).
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HASH_PREFIX = "sha256:"
PLAIN_PREFIX = "plain:"
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")  # what an unknown field may echo
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# The tenant of --api-key keys, and of every caller of a server without keys.
DEFAULT_TENANT = "default"
ANONYMOUS_TENANT = "anonymous"
_TENANT_FIELDS = {"name", "keys", "models", "max_priority", "limits", "share_prefix_cache"}
_LIMIT_FIELDS = {
    "requests_per_second",
    "burst",
    "tokens_per_minute",
    "max_concurrent_requests",
    "max_sessions",
}


class TenantConfigError(ValueError):
    """A key file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class TenantLimits:
    requests_per_second: float | None = None  # None: unlimited
    burst: int | None = None  # requests the bucket holds; default max(1, ceil(rps))
    tokens_per_minute: int | None = None  # generated tokens
    max_concurrent_requests: int | None = None
    max_sessions: int | None = None

    @property
    def request_burst(self) -> int:
        if self.burst is not None:
            return self.burst
        rps = self.requests_per_second or 1.0
        return max(1, -int(-rps // 1))


@dataclass(frozen=True)
class Tenant:
    name: str
    key_digests: tuple[bytes, ...]  # sha256 of each key
    models: tuple[str, ...] | None = None  # None: every model and adapter
    max_priority: int | None = None  # None: no clamp
    limits: TenantLimits = field(default_factory=TenantLimits)
    share_prefix_cache: bool = False

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models

    def clamp_priority(self, priority: int) -> int:
        """Lower values run first: a value below ``max_priority`` is raised to it."""
        if self.max_priority is None:
            return priority
        return max(priority, self.max_priority)


@dataclass(frozen=True)
class TenantConfig:
    tenants: tuple[Tenant, ...]
    path: str | None = None  # the key file (None: --api-key only)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def hash_key(key: str) -> str:
    """The key-file form of ``key``: ``sha256:<hex>``."""
    return HASH_PREFIX + key_digest(key).hex()


def load_tenant_file(path: str | Path) -> TenantConfig:
    """Read and validate a key file; ``TenantConfigError`` names the file and the field."""
    where = f"--api-key-file {path}"
    suffix = Path(path).suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise TenantConfigError(f"{where}: the extension must be .yaml, .yml or .toml")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantConfigError(f"{where}: cannot read ({exc})") from None
    try:
        data = tomllib.loads(text) if suffix == ".toml" else yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise TenantConfigError(f"{where}: {_syntax_error(exc)}") from None
    try:
        return parse_tenants(data, str(path))
    except TenantConfigError as exc:
        raise TenantConfigError(f"{where}: {exc}") from None


_QUOTED = re.compile(r"'([^']*)'|\"([^\"]*)\"")
_HARMLESS = re.compile(r".{0,2}|<[a-z ]+>")  # a character ('\t'), a token ('<block end>')


def _unquoted(message: str) -> str:
    """``message`` with every quoted text that could be a piece of a key replaced by ..."""

    def keep(match: re.Match[str]) -> str:
        inner = match.group(1) if match.group(1) is not None else match.group(2)
        return match.group(0) if _HARMLESS.fullmatch(inner) else "..."

    return _QUOTED.sub(keep, message)


def _syntax_error(exc: yaml.YAMLError | tomllib.TOMLDecodeError) -> str:
    """Where the file is broken and what the parser expected, never the text it found: the
    line may hold a key. PyYAML's message quotes the line itself (dropped: only the problem
    and its position are kept), and a quoted text longer than a character or a token name
    is replaced by ..."""
    if isinstance(exc, tomllib.TOMLDecodeError):
        return "not valid TOML: " + _unquoted(str(exc))
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or not isinstance(problem, str):
        return "not valid YAML"
    message = f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if isinstance(context, str) and start is not None:  # "while scanning a quoted scalar"
        message += f" ({context} at line {start.line + 1}, column {start.column + 1})"
    return _unquoted(message)


def parse_tenants(data: Any, path: str | None = None) -> TenantConfig:
    if not isinstance(data, Mapping) or set(data) != {"tenants"}:
        raise TenantConfigError("the file must hold exactly one top-level field, tenants")
    items = data["tenants"]
    if not isinstance(items, list) or not items:
        raise TenantConfigError("tenants: must be a non-empty list")
    tenants = tuple(_tenant(item, f"tenants[{i}]") for i, item in enumerate(items))
    _check_unique(tenants)
    return TenantConfig(tenants, path)


def _check_unique(tenants: tuple[Tenant, ...]) -> None:
    names: set[str] = set()
    owners: dict[bytes, str] = {}
    for i, tenant in enumerate(tenants):
        if tenant.name in names:
            raise TenantConfigError(f"tenants[{i}].name: {tenant.name!r} is used twice")
        names.add(tenant.name)
        for digest in tenant.key_digests:
            if digest in owners:
                raise TenantConfigError(
                    f"tenants[{i}].keys: a key of tenant {tenant.name!r} is also a key of "
                    f"tenant {owners[digest]!r}"
                )
            owners[digest] = tenant.name


def _tenant(item: Any, at: str) -> Tenant:
    if not isinstance(item, Mapping):
        raise TenantConfigError(f"{at}: must be a mapping")
    _no_unknown(item, _TENANT_FIELDS, at)
    name = item.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise TenantConfigError(
            f"{at}.name: required, 1-64 characters of letters, digits, '_', '.', '-' "
            "(starting with a letter or digit)"
        )
    if name == ANONYMOUS_TENANT:
        raise TenantConfigError(f"{at}.name: {ANONYMOUS_TENANT!r} is reserved")
    models = item.get("models")
    if models is not None and (
        not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)
    ):
        raise TenantConfigError(f"{at}.models: must be a list of model or adapter names")
    share = item.get("share_prefix_cache", False)
    if not isinstance(share, bool):
        raise TenantConfigError(f"{at}.share_prefix_cache: must be true or false")
    return Tenant(
        name=name,
        key_digests=_keys(item.get("keys"), f"{at}.keys"),
        models=None if models is None else tuple(models),
        max_priority=_integer(item.get("max_priority"), f"{at}.max_priority", minimum=None),
        limits=_limits(item.get("limits"), f"{at}.limits"),
        share_prefix_cache=share,
    )


def _keys(keys: Any, at: str) -> tuple[bytes, ...]:
    if not isinstance(keys, list) or not keys:
        raise TenantConfigError(f"{at}: required, a non-empty list")
    digests = []
    for i, key in enumerate(keys):
        # Never echo a key: the message names its position only.
        if isinstance(key, str) and key.startswith(HASH_PREFIX):
            hexdigest = key.removeprefix(HASH_PREFIX)
            if not re.fullmatch(r"[0-9a-fA-F]{64}", hexdigest):
                raise TenantConfigError(f"{at}[{i}]: sha256: must be followed by 64 hex digits")
            digests.append(bytes.fromhex(hexdigest))
        elif isinstance(key, str) and key.startswith(PLAIN_PREFIX) and len(key) > 6:
            digests.append(key_digest(key.removeprefix(PLAIN_PREFIX)))
        else:
            raise TenantConfigError(
                f"{at}[{i}]: must be 'sha256:<hex>' (tokenwire hash-key KEY) or, marked as "
                "such, 'plain:<key>'"
            )
    return tuple(digests)


def _limits(limits: Any, at: str) -> TenantLimits:
    if limits is None:
        return TenantLimits()
    if not isinstance(limits, Mapping):
        raise TenantConfigError(f"{at}: must be a mapping")
    _no_unknown(limits, _LIMIT_FIELDS, at)
    rps = limits.get("requests_per_second")
    if rps is not None and (
        isinstance(rps, bool) or not isinstance(rps, int | float) or not rps > 0
    ):
        raise TenantConfigError(f"{at}.requests_per_second: must be a positive number")
    burst = _integer(limits.get("burst"), f"{at}.burst")
    if burst is not None and rps is None:
        raise TenantConfigError(f"{at}.burst: needs requests_per_second")
    return TenantLimits(
        requests_per_second=None if rps is None else float(rps),
        burst=burst,
        tokens_per_minute=_integer(limits.get("tokens_per_minute"), f"{at}.tokens_per_minute"),
        max_concurrent_requests=_integer(
            limits.get("max_concurrent_requests"), f"{at}.max_concurrent_requests"
        ),
        max_sessions=_integer(limits.get("max_sessions"), f"{at}.max_sessions", minimum=0),
    )


def _integer(value: Any, at: str, minimum: int | None = 1) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TenantConfigError(f"{at}: must be an integer")
    if minimum is not None and value < minimum:
        raise TenantConfigError(f"{at}: must be at least {minimum}")
    return value


def _no_unknown(item: Mapping[str, Any], known: set[str], at: str) -> None:
    unknown = sorted(str(k) for k in item if k not in known)
    if not unknown:
        return
    if _FIELD_NAME.fullmatch(unknown[0]):
        raise TenantConfigError(f"{at}.{unknown[0]}: unknown field (known: {sorted(known)})")
    # Not echoed: a key on a line of its own parses as a field name ("plain:KEY: ...").
    raise TenantConfigError(f"{at}: an unknown field (known: {sorted(known)})")
