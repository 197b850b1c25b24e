"""``tokenwire serve --api-key-file`` as a real process: startup errors name the flag, SIGHUP
re-reads the key file (a bad file keeps the old tenants), and the tenant appears on the JSON
canonical log line and on ``/metrics``."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_helpers import greedy_request as request
from served_lines import _Lines, _serve_args, _start

from tokenwire.server.cli import main
from tokenwire.server.tenants.config import hash_key
from tokenwire.v1 import generation_pb2_grpc


def _key_file(path: Path, rps: float, burst: int) -> None:
    path.write_text(
        "tenants:\n"
        "  - name: team\n"
        f"    keys: ['{hash_key('team-key')}']\n"
        f"    limits: {{requests_per_second: {rps}, burst: {burst}}}\n"
    )


def test_startup_errors_name_the_flag(
    tiny_model_with_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "keys.yaml"
    bad.write_text("tenants:\n  - name: team\n    keys: [sha256:00]\n")
    good = tmp_path / "good.toml"
    good.write_text(f'[[tenants]]\nname = "default"\nkeys = ["{hash_key("k")}"]\n')
    other = tmp_path / "other.toml"
    other.write_text(f'[[tenants]]\nname = "team"\nkeys = ["{hash_key("k")}"]\n')
    cases = [
        (["--api-key-file", str(bad)], f"--api-key-file {bad}: tenants[0].keys[0]"),
        (["--api-key-file", str(tmp_path / "none.yaml")], "cannot read"),
        (["--api-key-file", str(good), "--api-key", "admin"], "rename it or drop --api-key"),
        (["--api-key-file", str(other), "--api-key", "k"], "--api-key: a key is also a key"),
    ]
    for flags, expected in cases:
        assert main(_serve_args(tiny_model_with_tokenizer, *flags)) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith("tokenwire: error: ") and expected in err, (flags, err)


def _generate_as_team(stub: generation_pb2_grpc.GenerationServiceStub, rid: str) -> grpc.StatusCode:
    """One short Generate with the key file's ``team`` key; its status code."""
    try:
        stub.Generate(
            request([1, 2, 3], 2, rid), metadata=(("authorization", "Bearer team-key"),), timeout=60
        )
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


@pytest.mark.slow
def test_sighup_reloads_the_key_file(tiny_model_with_tokenizer: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    _key_file(keys, rps=1000, burst=1000)
    proc = _start(
        tiny_model_with_tokenizer, "--log-format", "json", "--served-model-name", "tiny",
        "--api-key-file", str(keys), "--api-key", "admin-key",  # merged: "default"
    )  # fmt: skip
    try:
        out = _Lines(proc)
        match = out.wait_for(r"serving model=.* grpc=(\S+):(\d+) rest=http://(\S+):(\d+)")
        target, rest = (
            f"{match.group(1)}:{match.group(2)}",
            f"http://{match.group(3)}:{match.group(4)}",
        )
        with grpc.insecure_channel(target) as channel:
            generate = functools.partial(
                _generate_as_team, generation_pb2_grpc.GenerationServiceStub(channel)
            )
            assert [generate(f"a{i}") for i in range(3)] == [grpc.StatusCode.OK] * 3
            mark = len(out.lines)
            keys.write_text("tenants: [{name: team, keys: [oops]}]\n")
            proc.send_signal(signal.SIGHUP)
            out.wait_for("tenant key file reload failed", after=mark)
            assert generate("b0") == grpc.StatusCode.OK  # the old limits hold
            mark = len(out.lines)
            _key_file(keys, rps=0.01, burst=1)  # the level carries over, clipped to 1
            proc.send_signal(signal.SIGHUP)
            out.wait_for("tenant key file reloaded", after=mark)
            assert [generate(f"c{i}") for i in range(2)] == [
                grpc.StatusCode.OK,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            ]
        # The canonical line is written after the reply is sent: wait for it, not for the RPC.
        line = out.wait_for(
            r'^\{(?=.*"event": ?"request_finished")(?=.*"request_id": ?"c0").*', after=mark
        )
        assert json.loads(line.group(0))["tenant"] == "team"
        metrics = httpx.get(
            f"{rest}/metrics", headers={"authorization": "Bearer admin-key"}, timeout=30
        ).text
        assert re.search(r'request_success_total\{[^}]*tenant="team"[^}]*\} 5\.0', metrics)
        assert re.search(
            r'tenant_rate_limited_requests_total\{limit="requests_per_second",'
            r'model_name="tiny",tenant="team"\} 1\.0',
            metrics,
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_reload_interval_follows_a_kubernetes_secret_update(
    tiny_model_with_tokenizer: Path, tmp_path: Path
) -> None:
    """The key file mounted as a Secret volume (``keys.yaml -> ..data/keys.yaml``) is updated
    the kubelet's way, by swapping ``..data``; with ``--reload-interval`` and no SIGHUP the
    server re-reads it and the new limit holds."""
    secret = tmp_path / "secret"
    for version, rps in (("..v1", 1000.0), ("..v2", 0.01)):
        (secret / version).mkdir(parents=True)
        _key_file(secret / version / "keys.yaml", rps=rps, burst=1)
    (secret / "..data").symlink_to("..v1")
    (secret / "keys.yaml").symlink_to("..data/keys.yaml")
    keys = str(secret / "keys.yaml")
    proc = _start(tiny_model_with_tokenizer, "--api-key-file", keys, "--reload-interval", "0.1")
    try:
        out = _Lines(proc)
        target = out.wait_for(r"serving model=.* grpc=(\S+:\d+)").group(1)
        with grpc.insecure_channel(target) as channel:
            generate = functools.partial(
                _generate_as_team, generation_pb2_grpc.GenerationServiceStub(channel)
            )
            assert [generate(f"a{i}") for i in range(2)] == [grpc.StatusCode.OK] * 2
            mark = len(out.lines)
            os.symlink("..v2", secret / "..data_tmp")
            os.replace(secret / "..data_tmp", secret / "..data")  # one rename, no signal
            out.wait_for("tenant key file reloaded", after=mark)
            assert [generate(f"b{i}") for i in range(2)] == [
                grpc.StatusCode.OK,  # the burst of 1
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            ]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
