"""Tenants without a server: key-file parsing (errors name the field), token buckets on a
fake clock, the limit checks and their accounting, the priority clamp, cache salts, reloads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tokenwire.server.cli import main
from tokenwire.server.tenants.buckets import TokenBucket
from tokenwire.server.tenants.config import (
    TenantConfigError,
    hash_key,
    load_tenant_file,
    parse_tenants,
)
from tokenwire.server.tenants.limits import LimitExceeded
from tokenwire.server.tenants.registry import TenantRegistry


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tenant(name: str = "team-a", key: str = "key-a", **fields: object) -> dict[str, object]:
    return {"name": name, "keys": [hash_key(key)], **fields}


def registry(*tenants: dict[str, object], clock: FakeClock | None = None) -> TenantRegistry:
    return TenantRegistry(parse_tenants({"tenants": list(tenants)}), clock=clock or FakeClock())


# ------------------------------------------------------------------------ parsing
@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"keys": [hash_key("k")]}, "tenants[0].name"),
        (tenant(name="has space"), "tenants[0].name"),
        (tenant(name="anonymous"), "tenants[0].name"),
        ({"name": "a"}, "tenants[0].keys"),
        ({"name": "a", "keys": ["k-in-the-clear"]}, "tenants[0].keys[0]"),
        ({"name": "a", "keys": ["sha256:abc"]}, "tenants[0].keys[0]"),
        (tenant(limits={"requests_per_second": 0}), "tenants[0].limits.requests_per_second"),
        (tenant(limits={"requests_per_second": True}), "tenants[0].limits.requests_per_second"),
        (tenant(limits={"burst": 3}), "tenants[0].limits.burst"),
        (tenant(limits={"tokens_per_minute": 1.5}), "tenants[0].limits.tokens_per_minute"),
        (tenant(limits={"max_concurrent_requests": 0}), "limits.max_concurrent_requests"),
        (tenant(limits={"request_per_second": 5}), "tenants[0].limits.request_per_second"),
        (tenant(colour="red"), "tenants[0].colour"),
        (tenant(models="tiny"), "tenants[0].models"),
        (tenant(max_priority="high"), "tenants[0].max_priority"),
        (tenant(share_prefix_cache="yes"), "tenants[0].share_prefix_cache"),
    ],
)
def test_parse_errors_name_the_field(entry: dict[str, object], field: str) -> None:
    with pytest.raises(TenantConfigError, match=re.escape(field)):
        parse_tenants({"tenants": [entry]})


def test_parse_errors_never_echo_a_key() -> None:
    with pytest.raises(TenantConfigError) as info:
        parse_tenants({"tenants": [{"name": "a", "keys": ["sk-live-secret"]}]})
    assert "sk-live-secret" not in str(info.value)


def test_duplicate_names_and_shared_keys_are_refused() -> None:
    with pytest.raises(TenantConfigError, match=r"tenants\[1\]\.name: 'a' is used twice"):
        parse_tenants({"tenants": [tenant("a", "k1"), tenant("a", "k2")]})
    with pytest.raises(TenantConfigError, match=r"tenants\[1\]\.keys: .*also a key of tenant 'a'"):
        parse_tenants({"tenants": [tenant("a", "k1"), tenant("b", "k1")]})


def test_yaml_and_toml_files_parse_alike(tmp_path: Path) -> None:
    yaml_file = tmp_path / "keys.yaml"
    yaml_file.write_text(
        "tenants:\n"
        "  - name: team-a\n"
        f"    keys: ['{hash_key('ka')}', 'plain:kb']\n"
        "    models: [tiny]\n"
        "    max_priority: 2\n"
        "    limits: {requests_per_second: 2.5, tokens_per_minute: 600, max_sessions: 0}\n"
    )
    toml_file = tmp_path / "keys.toml"
    toml_file.write_text(
        "[[tenants]]\n"
        'name = "team-a"\n'
        f'keys = ["{hash_key("ka")}", "plain:kb"]\n'
        'models = ["tiny"]\n'
        "max_priority = 2\n"
        "[tenants.limits]\n"
        "requests_per_second = 2.5\ntokens_per_minute = 600\nmax_sessions = 0\n"
    )
    a, b = load_tenant_file(yaml_file), load_tenant_file(toml_file)
    assert a.tenants == b.tenants
    (t,) = a.tenants
    assert t.models == ("tiny",) and t.max_priority == 2 and not t.share_prefix_cache
    assert t.limits.requests_per_second == 2.5 and t.limits.request_burst == 3
    assert len(t.key_digests) == 2


def test_file_errors_name_the_flag_and_file(tmp_path: Path) -> None:
    bad = tmp_path / "keys.yaml"
    bad.write_text("tenants: [ {name: a, keys: [")
    with pytest.raises(TenantConfigError, match=rf"--api-key-file {bad}: not valid YAML"):
        load_tenant_file(bad)
    with pytest.raises(TenantConfigError, match=r"extension must be \.yaml, \.yml or \.toml"):
        load_tenant_file(tmp_path / "keys.json")
    with pytest.raises(TenantConfigError, match="cannot read"):
        load_tenant_file(tmp_path / "missing.toml")


def test_hash_key_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hash-key", "secret"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == "sha256:2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"
    reg = TenantRegistry(parse_tenants({"tenants": [{"name": "a", "keys": [printed]}]}))
    assert reg.is_valid("secret") and not reg.is_valid("secreT")


# ------------------------------------------------------------------------ buckets
def test_token_bucket_refills_at_its_rate_up_to_its_capacity() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, capacity=3.0, clock=clock)
    assert [bucket.try_take() for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
    assert bucket.try_take() == pytest.approx(0.5)  # one token every 1/2 s
    clock.now += 0.25
    assert bucket.try_take() == pytest.approx(0.25)  # a refused take takes nothing
    clock.now += 0.25
    assert bucket.try_take() == 0.0
    clock.now += 100.0
    assert bucket.level == 3.0  # never above the capacity


def test_token_bucket_charge_makes_a_debt_and_reconfigure_keeps_it() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=10.0, capacity=60.0, clock=clock)
    bucket.charge(100)
    assert bucket.level == pytest.approx(-40.0)
    assert bucket.wait_time(1.0) == pytest.approx(4.1)
    bucket.reconfigure(rate=20.0, capacity=30.0)  # a reload neither refills nor forgives
    assert bucket.level == pytest.approx(-40.0)
    clock.now += 2.0
    assert bucket.level == pytest.approx(0.0)
    clock.now += 10.0
    assert bucket.level == 30.0


# ------------------------------------------------------------------------ limits
def test_requests_per_second_names_the_limit_and_the_wait() -> None:
    clock = FakeClock()
    reg = registry(tenant(limits={"requests_per_second": 5, "burst": 2}), clock=clock)
    caller = reg.identify("key-a")
    assert caller is not None
    reg.admit(caller).release()
    reg.admit(caller).release()
    with pytest.raises(LimitExceeded) as info:
        reg.admit(caller)
    assert str(info.value) == "tenant 'team-a' exceeded requests_per_second=5"
    assert info.value.limit == "requests_per_second"
    assert info.value.retry_after == pytest.approx(0.2)
    clock.now += 0.2
    reg.admit(caller).release()


def test_tokens_per_minute_refuses_once_the_bucket_is_empty() -> None:
    clock = FakeClock()
    reg = registry(tenant(limits={"tokens_per_minute": 60}), clock=clock)
    caller = reg.identify("key-a")
    assert caller is not None
    running = reg.admit(caller)
    running.charge(50)
    second = reg.admit(caller)  # 10 left: admitted
    running.charge(30)  # a running request may finish past the limit (a debt of 20)
    second.release()
    running.release()
    with pytest.raises(LimitExceeded, match="exceeded tokens_per_minute=60") as info:
        reg.admit(caller)
    assert info.value.retry_after == pytest.approx(21.0)  # 1 token per second
    clock.now += 21.0
    reg.admit(caller).release()


def test_concurrency_and_session_caps_count_leases() -> None:
    reg = registry(tenant(limits={"max_concurrent_requests": 2, "max_sessions": 1}))
    caller = reg.identify("key-a")
    assert caller is not None
    first, second = reg.admit(caller), reg.admit(caller)
    with pytest.raises(LimitExceeded, match="max_concurrent_requests=2"):
        reg.admit(caller)
    first.release()
    first.release()  # idempotent: releasing twice frees one slot only
    third = reg.admit(caller)
    with pytest.raises(LimitExceeded, match="max_concurrent_requests=2"):
        reg.admit(caller)
    session = reg.open_session(caller)
    with pytest.raises(LimitExceeded, match="exceeded max_sessions=1") as info:
        reg.open_session(caller)
    assert info.value.retry_after > 0
    for lease in (second, third, session):
        lease.release()
    assert caller.usage.in_flight == 0 and caller.usage.sessions == 0


def test_a_refused_request_takes_no_rate_token() -> None:
    reg = registry(
        tenant(limits={"requests_per_second": 1, "burst": 1, "max_concurrent_requests": 1})
    )
    caller = reg.identify("key-a")
    assert caller is not None
    held = reg.admit(caller)  # takes the one rate token
    with pytest.raises(LimitExceeded, match="max_concurrent_requests"):
        reg.admit(caller)
    held.release()
    assert caller.usage.requests is not None and caller.usage.requests.level < 1


def test_priority_clamp_lower_values_run_first() -> None:
    reg = registry(tenant(max_priority=5), tenant("free", "key-f"))
    capped, free = reg.identify("key-a"), reg.identify("key-f")
    assert capped is not None and free is not None
    assert capped.tenant.clamp_priority(-10) == 5  # more urgent than allowed: raised
    assert capped.tenant.clamp_priority(0) == 5
    assert capped.tenant.clamp_priority(9) == 9  # less urgent: kept
    assert free.tenant.clamp_priority(-10) == -10


def test_identity_models_and_cache_salts() -> None:
    reg = registry(
        tenant(models=["tiny"]),
        tenant("b", "key-b"),
        tenant("c", "key-c", share_prefix_cache=True),
    )
    a, b, c = reg.identify("key-a"), reg.identify("key-b"), reg.identify("key-c")
    assert a is not None and b is not None and c is not None
    assert reg.identify("nope") is None and reg.identify(None) is None
    assert a.namespace == "tenant:team-a" and b.namespace == "tenant:b"
    assert a.tenant.allows_model("tiny") and not a.tenant.allows_model("other")
    assert b.tenant.allows_model("anything")
    assert a.cache_salt(None) != b.cache_salt(None)
    assert a.cache_salt("x") not in (b.cache_salt("x"), a.cache_salt(None))
    assert c.cache_salt(None) is None
    # A sharing tenant cannot pick a salt that reaches an isolated tenant's blocks.
    assert c.cache_salt(a.cache_salt(None)) != a.cache_salt(None)
    assert reg.names == ("anonymous", "b", "c", "team-a")


def test_open_server_and_api_key_tenants() -> None:
    open_reg = TenantRegistry()
    anon = open_reg.identify(None)
    assert not open_reg.auth_required
    assert anon is not None and anon.name == "anonymous" and anon.namespace == "anon"
    keys = TenantRegistry(api_keys=("k1", "k2"))
    one, two = keys.identify("k1"), keys.identify("k2")
    assert one is not None and two is not None and keys.identify(None) is None
    assert one.name == two.name == "default"
    assert one.namespace != two.namespace  # --api-key: ids stay scoped per key


def test_api_key_and_key_file_merge_or_conflict() -> None:
    config = parse_tenants({"tenants": [tenant()]})
    merged = TenantRegistry(config, api_keys=("admin",))
    admin = merged.identify("admin")
    assert admin is not None and admin.name == "default"
    assert merged.identify("key-a") is not None
    with pytest.raises(TenantConfigError, match="--api-key: a key is also a key of tenant"):
        TenantRegistry(config, api_keys=("key-a",))
    named_default = parse_tenants({"tenants": [tenant("default")]})
    with pytest.raises(TenantConfigError, match="rename it or drop --api-key"):
        TenantRegistry(named_default, api_keys=("admin",))


def test_reload_changes_limits_keeps_accounting_and_survives_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(
        f"tenants:\n- name: a\n  keys: ['{hash_key('ka')}']\n"
        "  limits: {max_concurrent_requests: 3}\n"
    )
    reg = TenantRegistry(load_tenant_file(path), clock=FakeClock())
    caller = reg.identify("ka")
    assert caller is not None
    held = reg.admit(caller)
    path.write_text("tenants: [{name: a, keys: [nope]}]")
    assert not reg.reload()  # the old tenants stay
    assert reg.identify("ka") is not None
    path.write_text(
        f"tenants:\n- name: a\n  keys: ['{hash_key('ka2')}']\n"
        "  limits: {max_concurrent_requests: 1}\n"
    )
    assert reg.reload()
    assert reg.identify("ka") is None  # the old key is gone
    again = reg.identify("ka2")
    assert again is not None and again.usage is caller.usage  # the accounting carries over
    with pytest.raises(LimitExceeded, match="max_concurrent_requests=1"):
        reg.admit(again)  # the request admitted before the reload still counts
    assert held.usage is caller.usage
    held.release()
    reg.admit(again).release()
