"""TLS and mTLS on both ports with real certificates made by the test (``tls_certs``).

In-process servers (gRPC harness + the REST shim on its loop, connected the way ``tokenwire
serve`` connects them): TLS with a self-signed certificate, mTLS with a CA and a server
certificate that names only a DNS name (the shim and the clients override the TLS name).
A real ``tokenwire serve`` subprocess reloads its certificate on SIGHUP. Startup errors go
through the real CLI entry point and exit 2 naming the flag.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import ServerHarness
from tiny_models import TEST_KV_CACHE_BYTES
from tls_certs import Issued, TestCA, self_signed, serial_of
from tls_reload import _copy, _Lines, _peer_serial

from tokenwire.clients.channel import TlsOptions
from tokenwire.clients.chat import run_chat
from tokenwire.clients.client import Client
from tokenwire.clients.errors import UnavailableError
from tokenwire.clients.results import SessionEvent, TurnEnd
from tokenwire.server.cli import main
from tokenwire.server.rest.app import RestSettings
from tokenwire.server.rest.loopback import loopback_upstream
from tokenwire.server.rest.server import RestServer
from tokenwire.server.rest.upstream import Upstream
from tokenwire.server.tls.material import check_loopback, load_material, loopback_name
from tokenwire.server.tls.reloader import TlsReloader
from tokenwire.server.tls.settings import CertReqs, TlsSettings, parse_cert_reqs

DNS_NAME = "tokenwire.internal"


@dataclass(frozen=True)
class Pki:
    ca: TestCA
    server: Issued  # CA-signed, 127.0.0.1 + localhost
    server_dns: Issued  # CA-signed, only DNS_NAME
    client: Issued
    stranger_client: Issued  # from another CA
    selfsigned: Issued


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca = TestCA(folder / "ca")
    stranger = TestCA(folder / "stranger", name="stranger CA")
    return Pki(
        ca=ca,
        server=ca.server_cert(),
        server_dns=ca.issue("server-dns", DNS_NAME, dns=(DNS_NAME,)),
        client=ca.client_cert(),
        stranger_client=stranger.client_cert("stranger"),
        selfsigned=self_signed(folder / "self"),
    )


@dataclass
class Served:
    harness: ServerHarness
    rest: RestServer
    upstream: Upstream
    tls: TlsReloader

    @property
    def target(self) -> str:
        return self.harness.target


def _serve(model: Path, settings: TlsSettings) -> Served:
    """The gRPC server over TLS and the REST shim in front of it, as ``serve`` wires them."""
    tls = TlsReloader(settings)
    harness = ServerHarness(model, tls=tls, in_process=True).start()
    rest = RestServer(RestSettings(port=0), tls=tls)

    async def start() -> Upstream:
        upstream = loopback_upstream(harness.target, harness.settings.max_message_bytes, tls)
        await rest.start(upstream)
        return upstream

    return Served(harness, rest, harness.run(start()), tls)


def _stop(served: Served) -> None:
    served.harness.run(served.rest.stop())
    served.harness.run(served.upstream.close())
    served.harness.stop()


@pytest.fixture(scope="module")
def tls_server(tiny_model_with_tokenizer: Path, pki: Pki) -> Iterator[Served]:
    """TLS with a self-signed certificate; client certificates optional."""
    s = pki.selfsigned
    settings = TlsSettings(str(s.cert), str(s.key), str(pki.ca.files.cert), CertReqs.OPTIONAL)
    served = _serve(tiny_model_with_tokenizer, settings)
    yield served
    _stop(served)


@pytest.fixture(scope="module")
def mtls_server(tiny_model_with_tokenizer: Path, pki: Pki) -> Iterator[Served]:
    """mTLS: client certificates from the CA required; the server certificate names only
    DNS_NAME, so everyone connecting to 127.0.0.1 checks that name instead."""
    s = pki.server_dns
    settings = TlsSettings(str(s.cert), str(s.key), str(pki.ca.files.cert), CertReqs.REQUIRED)
    served = _serve(tiny_model_with_tokenizer, settings)
    yield served
    _stop(served)


def _https(ca: Path, client: Issued | None = None, check_name: bool = True) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = check_name  # the chain is verified either way
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    return httpx.Client(verify=context, timeout=60)


def _chat(base_url: str, http: httpx.Client) -> str:
    with openai.OpenAI(base_url=base_url, api_key="k", http_client=http, max_retries=0) as sdk:
        reply = sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    return reply.choices[0].message.content or ""


# ---------------------------------------------------------------------------------- TLS
def _tokens(target: str, tls: TlsOptions, count: int = 2) -> int:
    with Client(target, tls=tls, timeout=60) as client:
        reply = client.generate([1, 2, 3], max_tokens=count, ignore_eos=True)
    return reply.usage.completion_tokens


def _refused(target: str, tls: TlsOptions | None) -> bool:
    """True when the call fails UNAVAILABLE: no TLS session could be set up."""
    with Client(target, tls=tls, timeout=10, retry=None) as client:
        try:
            client.generate([1, 2, 3], max_tokens=1)
        except UnavailableError:
            return True
    return False


def test_grpc_over_tls(tls_server: Served, pki: Pki) -> None:
    assert _tokens(tls_server.target, TlsOptions(ca_certs=str(pki.selfsigned.cert)), 3) == 3
    assert _refused(tls_server.target, None)  # plaintext: no handshake
    # The self-signed certificate is not the CA's.
    assert _refused(tls_server.target, TlsOptions(str(pki.ca.files.cert)))


def test_rest_https_with_openai_sdk(tls_server: Served, pki: Pki) -> None:
    base_url = tls_server.rest.url + "/v1"
    assert base_url.startswith("https://")
    assert _chat(base_url, _https(pki.selfsigned.cert)) != ""  # optional: no certificate
    assert _chat(base_url, _https(pki.selfsigned.cert, pki.client)) != ""  # or a valid one
    with pytest.raises(openai.APIConnectionError):  # an unverifiable one is refused
        _chat(base_url, _https(pki.selfsigned.cert, pki.stranger_client))
    with pytest.raises(openai.APIConnectionError):  # the client does not trust the server
        _chat(base_url, _https(pki.ca.files.cert))


def test_chat_cli_over_tls(tls_server: Served, pki: Pki) -> None:
    lines = iter(["Hi", "/exit"])
    out = io.StringIO()
    tls = TlsOptions(ca_certs=str(pki.selfsigned.cert))
    status = run_chat(
        tls_server.target, None, "", None, 3, 0.0, input_fn=lambda _: next(lines), out=out, tls=tls
    )
    assert status == 0 and "3 tokens" in out.getvalue()


@pytest.mark.slow
def test_rest_command_alone_over_tls(tls_server: Served, pki: Pki, tmp_path: Path) -> None:
    """``tokenwire rest``: HTTPS itself, TLS (with a client certificate) to the gRPC server."""
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None
    s = pki.server
    cmd = [exe, "rest", "--grpc-target", tls_server.target, "--port", "0"]
    cmd += ["--grpc-ca-certs", str(pki.selfsigned.cert), "--grpc-certfile", str(pki.client.cert)]
    cmd += ["--grpc-keyfile", str(pki.client.key), "--ssl-certfile", str(s.cert)]
    cmd += ["--ssl-keyfile", str(s.key), "--log-format", "console"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )  # fmt: skip
    try:
        url = _Lines(proc).wait_for(r"serving rest=(https://\S+) ").group(1)
        assert _chat(url + "/v1", _https(pki.ca.files.cert)) != ""
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


# --------------------------------------------------------------------------------- mTLS
def test_grpc_mtls_requires_a_client_certificate(mtls_server: Served, pki: Pki) -> None:
    ca, target = str(pki.ca.files.cert), mtls_server.target
    good = TlsOptions(ca, str(pki.client.cert), str(pki.client.key), server_name=DNS_NAME)
    assert _tokens(target, good) == 2
    stranger = pki.stranger_client
    assert _refused(target, TlsOptions(ca, server_name=DNS_NAME))  # no client certificate
    assert _refused(target, TlsOptions(ca, str(stranger.cert), str(stranger.key), DNS_NAME))
    # 127.0.0.1 is not a name of the certificate.
    assert _refused(target, TlsOptions(ca, str(pki.client.cert), str(pki.client.key)))


def test_rest_mtls_with_openai_sdk(mtls_server: Served, pki: Pki) -> None:
    """The shim reaches the gRPC server over mTLS with the server's own certificate."""
    base_url = mtls_server.rest.url + "/v1"  # 127.0.0.1: not a name of the certificate
    assert _chat(base_url, _https(pki.ca.files.cert, pki.client, check_name=False)) != ""
    for bad in (None, pki.stranger_client):
        with pytest.raises(openai.APIConnectionError):
            _chat(base_url, _https(pki.ca.files.cert, bad, check_name=False))
    assert (
        loopback_name(
            check_loopback(mtls_server.tls.settings, mtls_server.tls.material), "127.0.0.1"
        )
        == DNS_NAME
    )


def test_reload_keeps_the_old_certificate_when_the_new_files_are_bad(
    tmp_path: Path, pki: Pki
) -> None:
    live = _copy(pki.server, tmp_path / "live")
    tls = TlsReloader(TlsSettings(str(live.cert), str(live.key)))
    context = tls.ssl_context()
    served = serial_of(tls.material.cert_chain)
    live.cert.write_bytes(pki.server_dns.cert_pem)  # the old key does not match the new cert
    assert not tls.reload()
    assert serial_of(tls.material.cert_chain) == served and tls.reloads == 0
    _copy(pki.server_dns, tmp_path / "live")
    assert tls.reload()
    assert serial_of(tls.material.cert_chain) == serial_of(pki.server_dns.cert_pem)
    assert tls.ssl_context() is context  # the one uvicorn holds, reloaded in place
    assert tls._fetch() is not None and tls._fetch() is None  # handed to gRPC exactly once


def _turn_tokens(events: Iterator[SessionEvent]) -> int:
    ends = [e for e in events if isinstance(e, TurnEnd)]
    assert len(ends) == 1, ends
    return ends[0].usage.completion_tokens


@pytest.mark.slow
def test_sighup_reloads_certificates_without_dropping_connections(
    tiny_model_with_tokenizer: Path, pki: Pki, tmp_path: Path
) -> None:
    live = _copy(pki.server, tmp_path / "live")
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None
    cmd = [exe, "serve", str(tiny_model_with_tokenizer), "--engine-in-process", "--grpc-port", "0"]
    cmd += ["--port", "0", "--log-format", "json", "--ssl-certfile", str(live.cert)]
    cmd += ["--ssl-keyfile", str(live.key), "--ssl-ca-certs", str(pki.ca.files.cert)]
    cmd += ["--ssl-cert-reqs", "required", "--max-model-len", "256", "--served-model-name", "tiny"]
    cmd += ["--kv-cache-memory", str(TEST_KV_CACHE_BYTES)]
    cmd += ["--grpc-max-connection-age", "600", "--grpc-keepalive-time", "60"]  # accepted
    cmd += ["--header-timeout", "5", "--timeout-keep-alive", "5"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )  # fmt: skip
    try:
        out = _Lines(proc)
        match = out.wait_for(r"serving model=.* grpc=(\S+):(\d+) rest=https://(\S+):(\d+)")
        host, grpc_port, rest_port = match.group(1), int(match.group(2)), int(match.group(4))
        target, ca = f"{host}:{grpc_port}", pki.ca.files.cert
        tls = TlsOptions(str(ca), str(pki.client.cert), str(pki.client.key))
        old, new = serial_of(pki.server.cert_pem), serial_of(pki.server_dns.cert_pem)
        assert _peer_serial(host, grpc_port, ca, pki.client, "h2") == old
        with (
            Client(target, tls=tls, timeout=60) as client,
            client.session(max_tokens=3, ignore_eos=True) as session,
        ):
            assert _turn_tokens(session.send("Hi")) == 3  # a stream on the old connection

            # A bad rotation (mismatched key) is refused and the old certificate stays.
            live.cert.write_bytes(pki.server_dns.cert_pem)
            proc.send_signal(signal.SIGHUP)
            out.wait_for("TLS reload failed")
            assert _peer_serial(host, grpc_port, ca, pki.client, "h2") == old

            # The server certificate now names only DNS_NAME: new clients check that name.
            _copy(pki.server_dns, tmp_path / "live")
            proc.send_signal(signal.SIGHUP)
            out.wait_for("TLS certificates reloaded")
            assert _peer_serial(host, grpc_port, ca, pki.client, "h2") == new
            assert _peer_serial(host, rest_port, ca, pki.client, "http/1.1") == new
            assert _turn_tokens(session.send("Again")) == 3  # the old connection lives on
        renamed = TlsOptions(str(ca), str(pki.client.cert), str(pki.client.key), DNS_NAME)
        with Client(target, tls=renamed, timeout=60) as client:
            assert (
                client.generate([1, 2], max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
            )
        # The REST shim reconnected with the new certificate (as its client certificate too).
        http = _https(ca, pki.client, check_name=False)  # the certificate names DNS_NAME
        assert _chat(f"https://{host}:{rest_port}/v1", http) != ""
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


# ------------------------------------------------------------------------ startup errors
def _serve_args(model: Path, *flags: str) -> list[str]:
    return ["serve", str(model), "--grpc-port", "0", "--port", "0", *flags]


def test_startup_errors_name_the_flag(
    tiny_model_with_tokenizer: Path, pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model_with_tokenizer
    cert, key, ca = str(pki.server.cert), str(pki.server.key), str(pki.ca.files.cert)
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    unreadable = tmp_path / "secret.pem"
    unreadable.write_bytes(pki.server.key_pem)
    unreadable.chmod(0)
    cases = [
        (["--ssl-certfile", str(tmp_path / "missing.pem")], "--ssl-certfile"),
        (["--ssl-certfile", cert, "--ssl-keyfile", str(not_pem)], "--ssl-keyfile"),
        (["--ssl-certfile", str(not_pem), "--ssl-keyfile", key], "--ssl-certfile"),
        (["--ssl-certfile", cert, "--ssl-keyfile", str(pki.client.key)], "does not match"),
        (["--ssl-keyfile", key], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "required"],
         "needs --ssl-ca-certs"),
        (["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", str(not_pem)],
         "--ssl-ca-certs"),
        # mTLS with the REST shim: it presents the server certificate, which must verify.
        (["--ssl-certfile", str(pki.selfsigned.cert), "--ssl-keyfile", str(pki.selfsigned.key),
          "--ssl-ca-certs", ca, "--ssl-cert-reqs", "2"], "--disable-rest"),
    ]  # fmt: skip
    if os.geteuid() != 0:  # root reads any file
        cases.append((["--ssl-certfile", cert, "--ssl-keyfile", str(unreadable)], "--ssl-keyfile"))
    for flags, expected in cases:
        assert main(_serve_args(model, *flags)) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith("tokenwire: error: ") and expected in err, (flags, err)
    with pytest.raises(SystemExit) as exited:  # argparse: a value outside the choices
        main(_serve_args(model, "--ssl-certfile", cert, "--ssl-cert-reqs", "sometimes"))
    assert exited.value.code == 2 and "--ssl-cert-reqs" in capsys.readouterr().err


def test_startup_error_exit_code_of_the_real_command(tmp_path: Path) -> None:
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None
    missing = str(tmp_path / "missing.pem")
    done = subprocess.run(
        [exe, "serve", "--engine-in-process", "--ssl-certfile", missing],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONSAFEPATH="1"),
    )  # fmt: skip
    assert done.returncode == 2
    assert f"cannot read --ssl-certfile {missing}" in done.stderr


def test_cert_reqs_forms_and_key_in_the_certificate_file(pki: Pki, tmp_path: Path) -> None:
    assert (
        parse_cert_reqs("2") is CertReqs.REQUIRED
        and parse_cert_reqs("Optional") is CertReqs.OPTIONAL
    )
    assert parse_cert_reqs("0") is CertReqs.NONE
    combined = tmp_path / "combined.pem"  # uvicorn/vLLM allow the key inside --ssl-certfile
    combined.write_bytes(pki.server.key_pem + pki.server.cert_pem)
    material = load_material(TlsSettings(str(combined)))
    assert material.cert_chain == pki.server.cert_pem and b"PRIVATE KEY" in material.private_key
    assert b"CERTIFICATE" not in material.private_key
