"""Certificate files swapped under a running server, and the serial number its peers see."""

from __future__ import annotations

import os
import re
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

from tls_certs import Issued, serial_of


# ------------------------------------------------------------------------------- reload
def _copy(issued: Issued, folder: Path) -> Issued:
    """Rotate files the way a secret mount does: write aside, then rename over."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "tls.crt", folder / "tls.key"
    for src, dst in ((issued.key, key), (issued.cert, cert)):
        shutil.copyfile(src, dst.with_suffix(".tmp"))
        os.replace(dst.with_suffix(".tmp"), dst)
    return Issued(cert, key)


def _peer_serial(host: str, port: int, ca: Path, client: Issued, alpn: str) -> int:
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False  # either certificate: only the serial matters here
    context.load_cert_chain(client.cert, client.key)
    context.set_alpn_protocols([alpn])
    with (
        socket.create_connection((host, port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as sock,
    ):
        der = sock.getpeercert(binary_form=True)
    assert der is not None
    return serial_of(ssl.DER_cert_to_PEM_cert(der).encode())


class _Lines:
    """The server's stdout, line by line, with a wait for a pattern."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        for line in proc.stdout or ():
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        found: list[re.Match[str]] = []

        def seen() -> bool:
            found[:] = [m for line in self.lines if (m := re.search(pattern, line))]
            return bool(found)

        with self.cond:
            assert self.cond.wait_for(seen, timeout), f"no {pattern!r} in:\n{''.join(self.lines)}"
        return found[0]
