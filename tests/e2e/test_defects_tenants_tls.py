"""Defects #8: a certificate outside its validity period is refused at startup and at every
reload (SIGHUP and the ``--reload-interval`` file watch); the server keeps the certificate it
has and logs why. Certificates are real (``tls_certs``), one day expired or one day early."""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import TEST_KV_CACHE_BYTES
from tls_certs import Issued, TestCA, serial_of
from tls_reload import _copy, _Lines, _peer_serial

from tokenwire.server.file_watch import FileWatcher
from tokenwire.server.tls.material import load_material
from tokenwire.server.tls.reloader import TlsReloader
from tokenwire.server.tls.settings import TlsSettings
from tokenwire.server.tls.validity import validity

DAY = datetime.timedelta(days=1)
PERIODS = {"expired": (-30 * DAY, -DAY), "not yet valid": (DAY, 30 * DAY)}


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def certs(ca: TestCA) -> dict[str, Issued]:
    """A good server certificate, a second good one, and one per bad validity period."""
    made = {"good": ca.server_cert("good"), "next": ca.server_cert("next")}
    for name, period in PERIODS.items():
        made[name] = ca.server_cert(name.replace(" ", "-"), valid=period)
    return made


def test_the_validity_period_is_read_from_the_certificate(certs: dict[str, Issued]) -> None:
    now = datetime.datetime.now(datetime.UTC)
    not_before, not_after = validity(certs["expired"].cert_pem.decode())
    assert not_before < not_after < now
    not_before, _ = validity(certs["not yet valid"].cert_pem.decode())
    assert not_before > now


@pytest.mark.parametrize("bad", sorted(PERIODS))
def test_startup_refuses_a_certificate_outside_its_validity(
    certs: dict[str, Issued], bad: str
) -> None:
    """What ``serve`` builds before the model loads, with or without the REST shim."""
    files = certs[bad]
    with pytest.raises(ValueError, match=f"--ssl-certfile {files.cert}: the certificate"):
        TlsReloader(TlsSettings(str(files.cert), str(files.key)))


@pytest.mark.parametrize("bad", sorted(PERIODS))
def test_sighup_reload_keeps_the_certificate(
    certs: dict[str, Issued], tmp_path: Path, bad: str
) -> None:
    live = _copy(certs["good"], tmp_path / "live")
    settings = TlsSettings(str(live.cert), str(live.key))
    tls = TlsReloader(settings)
    context = tls.ssl_context()
    served = serial_of(tls.material.cert_chain)
    _copy(certs[bad], tmp_path / "live")
    assert not tls.reload()
    assert serial_of(tls.material.cert_chain) == served and tls.reloads == 0
    assert tls._fetch() is None  # nothing new handed to gRPC
    word = "expired" if bad == "expired" else "not valid before"
    with pytest.raises(ValueError, match=f"--ssl-certfile {live.cert}: the certificate .*{word}"):
        load_material(settings)  # what the reload logged
    _copy(certs["next"], tmp_path / "live")  # a good rotation still goes through
    assert tls.reload() and tls.ssl_context() is context
    assert serial_of(tls.material.cert_chain) == serial_of(certs["next"].cert_pem)


def test_file_watch_reload_refuses_an_expired_certificate(
    certs: dict[str, Issued], tmp_path: Path
) -> None:
    """``--reload-interval``: the watcher runs the same reload on a change it sees."""
    live = _copy(certs["good"], tmp_path / "live")
    tls = TlsReloader(TlsSettings(str(live.cert), str(live.key)))
    served = serial_of(tls.material.cert_chain)
    watcher = FileWatcher([str(live.cert), str(live.key)], tls.reload)
    _copy(certs["expired"], tmp_path / "live")
    assert watcher.check()  # a change was seen and the reload ran
    assert serial_of(tls.material.cert_chain) == served and tls.reloads == 0
    _copy(certs["next"], tmp_path / "live")
    assert watcher.check() and tls.reloads == 1
    assert serial_of(tls.material.cert_chain) == serial_of(certs["next"].cert_pem)


@pytest.mark.slow
def test_a_served_process_keeps_its_certificate_on_an_expired_sighup(
    tiny_model_with_tokenizer: Path, certs: dict[str, Issued], ca: TestCA, tmp_path: Path
) -> None:
    live = _copy(certs["good"], tmp_path / "live")
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None
    cmd = [exe, "serve", str(tiny_model_with_tokenizer), "--engine-in-process", "--grpc-port", "0"]
    cmd += ["--port", "0", "--log-format", "json", "--max-model-len", "256"]
    cmd += ["--kv-cache-memory", str(TEST_KV_CACHE_BYTES)]
    cmd += ["--ssl-certfile", str(live.cert), "--ssl-keyfile", str(live.key)]
    cmd += ["--ssl-ca-certs", str(ca.files.cert)]  # the REST shim's root
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )  # fmt: skip
    try:
        out = _Lines(proc)
        match = out.wait_for(r"serving model=.* grpc=(\S+):(\d+) rest=https://(\S+):(\d+)")
        host, grpc_port, rest_port = match.group(1), int(match.group(2)), int(match.group(4))
        client = ca.client_cert()
        old = serial_of(certs["good"].cert_pem)
        _copy(certs["expired"], tmp_path / "live")
        proc.send_signal(signal.SIGHUP)
        line = out.wait_for(".*(TLS reload failed|TLS certificates reloaded).*").group(0)
        assert "TLS reload failed" in line and "the certificate expired at" in line, line
        # Verifying clients still get the old certificate, on both ports.
        assert _peer_serial(host, grpc_port, ca.files.cert, client, "h2") == old
        assert _peer_serial(host, rest_port, ca.files.cert, client, "http/1.1") == old
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
