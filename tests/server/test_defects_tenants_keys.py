"""Defects #5: no key, token or hash material reaches a log line, a span or an error message.

A real ``tokenwire serve`` process with an ``--api-key-file`` (a hashed and a ``plain:`` key)
and ``--api-key``, exporting spans to a real OTLP receiver, runs through a tenant's day:
requests with good and bad keys over gRPC and REST, a Session, rate-limit refusals, and a
SIGHUP reload of a key file with a YAML syntax error on the line that holds the keys. Every
line it printed (stdout and stderr), every span attribute it exported and every error it
returned is then searched for each key, its sha256 hash and the hash's prefix.
"""

from __future__ import annotations

import hashlib
import os
import queue
import signal
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_helpers import greedy_request as request
from grpc_status import rpc_status
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from otlp_receiver import Receiver, attrs
from served_lines import _Lines, _start

from tokenwire.server.tenants.config import hash_key, load_tenant_file
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc, models_pb2_grpc

pb = generation_pb2
TEAM, PLAIN = "team-secret-3f9c1a0d", "plain-secret-77d2e0b4"
ADMIN, WRONG = "admin-secret-b41c08e6", "wrong-secret-e5a9d3c2"


def _material(key: str) -> list[str]:
    """What must never be shown of ``key``: itself, its sha256 and the hash's prefix."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    return [key, digest, digest[:16], digest[-16:]]


def _leaks(texts: list[str]) -> list[str]:
    """Each text that shows a secret, cut around it."""
    return [
        text[max(0, text.index(secret) - 120) : text.index(secret) + 40]
        for text in texts
        for key in (TEAM, PLAIN, ADMIN, WRONG)
        for secret in _material(key)
        if secret in text
    ]


def _key_file(path: Path, broken: bool = False) -> None:
    keys = f"['{hash_key(TEAM)}', 'plain:{PLAIN}']"
    if broken:  # an unclosed quote on the line that holds both keys
        keys = f"['{hash_key(TEAM)}', \"plain:{PLAIN}"
    path.write_text(
        "tenants:\n"
        "  - name: team\n"
        f"    keys: {keys}\n"
        "    limits: {requests_per_second: 0.01, burst: 2}\n"
    )


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _error_text(err: grpc.RpcError) -> str:
    """Everything a client is told about a failed call: message and status details."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    return f"{err.code()} {err.details()} {status}"


class _Client:
    """Calls of every kind against the server; keeps every error text it got back."""

    def __init__(self, target: str, rest_url: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.models = models_pb2_grpc.ModelServiceStub(self.channel)
        self.rest = rest_url
        self.errors: list[str] = []

    def grpc(self, call: Callable[[], Any]) -> grpc.StatusCode:
        try:
            call()
        except grpc.RpcError as err:
            self.errors.append(_error_text(err))
            return err.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    def generate(self, key: str) -> grpc.StatusCode:
        return self.grpc(lambda: self.stub.Generate(request([1, 2, 3], 2), metadata=auth(key)))

    def stream(self, key: str) -> grpc.StatusCode:
        return self.grpc(
            lambda: list(self.stub.GenerateStream(request([4, 5], 2), metadata=auth(key)))
        )

    def session(self, key: str) -> list[str]:
        """Open, one good turn, one invalid turn (each read to its TurnEnd), Close; the
        replies as text."""
        outbox: queue.Queue[pb.SessionRequest | None] = queue.Queue()
        stopping = common_pb2.StoppingOptions(max_tokens=2, ignore_eos=True)
        turns = [
            pb.SessionTurn(token_ids=common_pb2.TokenIds(ids=[7, 8])),
            pb.SessionTurn(
                token_ids=common_pb2.TokenIds(ids=[9]),
                sampling=common_pb2.SamplingOptions(temperature=-1.0),
            ),
        ]
        outbox.put(pb.SessionRequest(open=pb.SessionOpen(stopping=stopping)))
        replies: list[str] = []

        def converse() -> None:
            for reply in self.stub.Session(iter(outbox.get, None), metadata=auth(key)):
                replies.append(str(reply))
                if reply.HasField("opened") or reply.HasField("turn_end"):
                    turn = turns.pop(0) if turns else None
                    outbox.put(pb.SessionRequest(turn=turn) if turn else None)

        replies.append(str(self.grpc(converse)))
        return replies

    def http(self, method: str, path: str, key: str, **body: Any) -> int:
        reply = httpx.request(
            method, f"{self.rest}{path}", headers={"authorization": f"Bearer {key}"},
            json=body or None, timeout=60,
        )  # fmt: skip
        if reply.status_code >= 400:
            self.errors.append(f"{reply.status_code} {reply.headers} {reply.text}")
        return reply.status_code


@pytest.fixture()
def receiver() -> Iterator[tuple[Receiver, int]]:
    found = Receiver()
    otlp = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(found, otlp)
    port = otlp.add_insecure_port("127.0.0.1:0")
    otlp.start()
    yield found, port
    otlp.stop(0)


def _day(client: _Client, out: _Lines, proc: Any, keys: Path) -> list[str]:
    """Requests of every kind, refusals and a broken reload; the session replies."""
    assert client.generate(TEAM) == grpc.StatusCode.OK
    assert client.generate(PLAIN) == grpc.StatusCode.OK  # the team's burst of 2 is spent
    assert client.generate(TEAM) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.stream(ADMIN) == grpc.StatusCode.OK
    for bad in (WRONG, f"{TEAM}x", ""):
        assert client.generate(bad) == grpc.StatusCode.UNAUTHENTICATED
    replies = client.session(ADMIN)
    assert replies[-1] == str(grpc.StatusCode.OK) and "INVALID_PARAMETER" in "".join(replies)
    replies += client.session(TEAM)  # refused: the team's rate limit
    cancel = pb.CancelRequest(request_id="nobody")
    assert client.grpc(lambda: client.stub.Cancel(cancel, metadata=auth(ADMIN))) == (
        grpc.StatusCode.OK
    )
    completion = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert client.http("POST", "/v1/completions", ADMIN, **completion) == 200
    assert client.http("POST", "/v1/completions", TEAM, **completion) == 429
    assert client.http("POST", "/v1/completions", WRONG, **completion) == 401
    assert client.http("GET", "/metrics", WRONG) == 401
    mark = len(out.lines)
    _key_file(keys, broken=True)
    proc.send_signal(signal.SIGHUP)
    out.wait_for("tenant key file reload failed", after=mark)
    assert client.generate(TEAM) == grpc.StatusCode.RESOURCE_EXHAUSTED  # the old tenants
    return replies


@pytest.mark.slow
def test_no_key_or_hash_in_any_output(
    tiny_model_with_tokenizer: Path, tmp_path: Path, receiver: tuple[Receiver, int]
) -> None:
    spans, otlp_port = receiver
    keys = tmp_path / "keys.yaml"
    _key_file(keys)
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # read by the child at start
    try:
        proc = _start(
            tiny_model_with_tokenizer, "--log-format", "json", "--served-model-name", "tiny",
            "--api-key-file", str(keys), "--api-key", ADMIN,
            "--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_port}",
        )  # fmt: skip
    finally:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
    try:
        out = _Lines(proc)
        match = out.wait_for(r"serving model=.* grpc=(\S+:\d+) rest=(\S+)")
        client = _Client(match.group(1), match.group(2))
        try:
            replies = _day(client, out, proc, keys)
        finally:
            client.channel.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        exported = spans.wait_for(lambda s: any(x.name == "tokenwire.step" for x in s))
    finally:
        if proc.poll() is None:
            proc.kill()
    span_texts = [f"{s.name} {attrs(s)} {list(s.events)}" for s in exported]
    assert any("tokenwire.engine_request_id" in t for t in span_texts)  # ids were exported
    assert len(client.errors) >= 8
    everything = [*out.lines, *span_texts, *client.errors, *replies]
    leaks = _leaks(everything)
    assert not leaks, "\n".join(leaks)


BROKEN = {
    "unclosed.yaml": f"tenants:\n  - name: team\n    keys: ['{hash_key(TEAM)}', \"plain:{PLAIN}\n",
    "tab.yaml": f"tenants:\n  - name: team\n\tkeys: [plain:{PLAIN}]\n",
    "flow.yaml": f"tenants:\n  - name: team\n    keys: ['plain:{PLAIN}' : x\n   - b: c\n",
    "unclosed.toml": f'[[tenants]]\nname = "team"\nkeys = ["plain:{PLAIN}]\n',
    "field.yaml": f"tenants:\n  - name: team\n    keys: [a]\n    plain:{PLAIN}: x\n",
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_key_file_is_reported_without_its_keys(tmp_path: Path, name: str) -> None:
    """The message (the reload-failure log line, the startup error) names the file and where
    it is broken, never the text there: that line may hold a key."""
    keys = tmp_path / name
    keys.write_text(BROKEN[name])
    with pytest.raises(ValueError) as err:
        load_tenant_file(keys)
    message = str(err.value)
    assert not _leaks([message]), message
    assert message.startswith(f"--api-key-file {keys}: "), message
    if name != "field.yaml":
        assert "line 3" in message or "line 4" in message, message
