"""Remote image URLs (#33, ``--allowed-media-domains``): the fetch against a real HTTP server
on loopback. Only listed hosts (exact, case-insensitive) over http(s); a host resolving to a
private / loopback / reserved address is refused (loopback is allowed only by the tests-only
``allow_private``); redirects, non-2xx statuses, compressed bodies and bodies past the byte
limit are refused, each a 400 naming the part; the flag parses on ``serve`` and ``rest``."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from tls_certs import TestCA

from tokenwire.server.cli import build_parser
from tokenwire.server.rest.errors import RestError
from tokenwire.server.rest.media_fetch import (
    FetchedImage,
    MediaFetchPolicy,
    fetch_image,
    forbidden_address,
)
from tokenwire.server.rest.server import rest_settings

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4  # the bytes matter, not their decoding
LIMIT = 4096
PARAM = "messages.0.content.1"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        if self.path == "/img.png":
            self._send(200, PNG, {"content-type": "image/png; x=1"})
        elif self.path == "/redirect":
            self._send(302, b"", {"location": "/img.png"})
        elif self.path == "/big-declared":
            self._send(200, b"x" * (LIMIT + 1), {"content-type": "image/png"})
        elif self.path == "/big-streamed":  # no content-length: read until close
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"y" * 1024)
        elif self.path == "/hang":  # headers never come, until the test is over
            self.server.release.wait()  # type: ignore[attr-defined]
        elif self.path == "/gzip":
            self._send(200, PNG, {"content-type": "image/png", "content-encoding": "gzip"})
        else:
            self._send(404, b"no", {})

        self.server.hosts.append(self.headers.get("host", ""))  # type: ignore[attr-defined]

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if status != 200 or "big" in self.path or self.path in ("/img.png", "/gzip"):
            self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Origin(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hosts: list[str] = []  # each request's Host header
        self.server_names: list[str | None] = []  # each TLS handshake's SNI
        self.release = threading.Event()  # lets /hang's handlers go


def _serve(server: _Origin) -> Iterator[_Origin]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    for server in _serve(_Origin()):
        yield f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("media-ca"))


@pytest.fixture(scope="module")
def tls_origin(ca: TestCA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Origin]:
    """HTTPS on 127.0.0.1 with a certificate for the name ``localhost`` only (no IP)."""
    issued = ca.issue("origin", "localhost", dns=("localhost",))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(issued.cert, issued.key)
    server = _Origin()
    context.sni_callback = lambda sock, name, ctx: server.server_names.append(name)  # type: ignore[assignment,func-returns-value]
    server.socket = context.wrap_socket(server.socket, server_side=True)
    yield from _serve(server)


def _policy(
    *hosts: str, allow_private: bool = True, verify: ssl.SSLContext | bool = True
) -> MediaFetchPolicy:
    return MediaFetchPolicy(frozenset(hosts), LIMIT, 5.0, allow_private, verify)


def _fetch(url: str, policy: MediaFetchPolicy) -> FetchedImage:
    return asyncio.run(fetch_image(url, policy, PARAM))


def _refused(url: str, policy: MediaFetchPolicy) -> str:
    with pytest.raises(RestError) as info:
        _fetch(url, policy)
    assert (info.value.status, info.value.param) == (400, PARAM)
    return info.value.message


def test_an_allowed_host_is_fetched(origin: str) -> None:
    image = _fetch(f"{origin}/img.png", _policy("127.0.0.1"))
    assert image == FetchedImage(PNG, "image/png")


def test_https_is_pinned_to_the_checked_address_with_the_host_name_kept(
    tls_origin: _Origin, ca: TestCA
) -> None:
    """The connection goes to the resolved IP, yet TLS sends SNI ``localhost`` and checks the
    certificate against it (the certificate names no IP), and ``Host`` is the URL's."""
    port = tls_origin.server_address[1]
    url = f"https://localhost:{port}/img.png"
    trusted = ssl.create_default_context(cafile=str(ca.files.cert))
    image = _fetch(url, _policy("localhost", verify=trusted))
    assert image == FetchedImage(PNG, "image/png")
    assert tls_origin.server_names[-1] == "localhost"
    assert tls_origin.hosts[-1] == f"localhost:{port}"
    # The certificate really is checked: the system's CAs do not know the test CA.
    assert "CERTIFICATE_VERIFY_FAILED" in _refused(url, _policy("localhost"))


def test_a_host_not_listed_is_refused_exactly(origin: str) -> None:
    port = origin.rsplit(":", 1)[1]
    message = _refused(f"{origin}/img.png", _policy("localhost"))
    assert "'127.0.0.1' is not in --allowed-media-domains" in message
    # Exact host names: a listed domain does not allow its subdomains; case does not matter.
    assert "not in" in _refused(f"http://sub.localhost:{port}/img.png", _policy("localhost"))
    upper = f"http://LOCALHOST:{port}/img.png"
    assert "private" in _refused(upper, _policy("localhost", allow_private=False))


def test_a_loopback_address_is_refused_as_private(origin: str) -> None:
    port = origin.rsplit(":", 1)[1]
    for url, host in ((f"http://localhost:{port}/img.png", "localhost"), (origin, "127.0.0.1")):
        message = _refused(url, _policy(host, allow_private=False))
        assert "resolves to a private or reserved address" in message


def test_other_schemes_and_credentials_are_refused(origin: str) -> None:
    assert "http:// or https://" in _refused("ftp://127.0.0.1/img.png", _policy("127.0.0.1"))
    with_user = origin.replace("http://", "http://user:pw@") + "/img.png"
    assert "user:password" in _refused(with_user, _policy("127.0.0.1"))


def test_a_redirect_is_not_followed(origin: str) -> None:
    assert "redirects (302)" in _refused(f"{origin}/redirect", _policy("127.0.0.1"))


def test_a_non_2xx_status_is_refused(origin: str) -> None:
    assert "HTTP 404" in _refused(f"{origin}/missing", _policy("127.0.0.1"))


@pytest.mark.parametrize("path", ["/big-declared", "/big-streamed"])
def test_a_body_past_the_limit_is_cut_and_refused(origin: str, path: str) -> None:
    message = _refused(f"{origin}{path}", _policy("127.0.0.1"))
    assert f"over {LIMIT} bytes (--max-image-bytes)" in message


def test_a_fetch_that_hangs_times_out(origin: str) -> None:
    policy = MediaFetchPolicy(frozenset({"127.0.0.1"}), LIMIT, 0.2, True)
    assert "took over 0.2s" in _refused(f"{origin}/hang", policy)


def test_a_compressed_body_is_refused(origin: str) -> None:
    assert "content-encoding 'gzip'" in _refused(f"{origin}/gzip", _policy("127.0.0.1"))


@pytest.mark.parametrize(
    ("address", "forbidden"),
    [
        ("10.1.2.3", True),
        ("172.16.0.1", True),
        ("192.168.1.1", True),
        ("127.0.0.1", True),
        ("169.254.169.254", True),  # cloud metadata
        ("224.0.0.1", True),
        ("0.0.0.0", True),
        ("240.0.0.1", True),
        ("100.64.0.1", True),  # shared address space (CGNAT)
        ("::1", True),
        ("::", True),
        ("fe80::1", True),
        ("fc00::1", True),
        ("ff02::1", True),
        ("::ffff:127.0.0.1", True),
        ("::ffff:10.0.0.1", True),
        ("8.8.8.8", False),
        ("::ffff:8.8.8.8", False),
        ("2606:4700:4700::1111", False),
    ],
)
def test_forbidden_addresses(address: str, forbidden: bool) -> None:
    assert forbidden_address(ipaddress.ip_address(address)) is forbidden


@pytest.mark.parametrize("command", ["serve", "rest"])
def test_the_flag_makes_the_policy(command: str) -> None:
    parser = build_parser()
    default = rest_settings(parser.parse_args([command]), 0).media
    assert default == MediaFetchPolicy() and not default.enabled
    args = parser.parse_args(
        [command, "--allowed-media-domains", "Images.Example.com", "cdn.example.org."]
    )
    media = rest_settings(args, 0).media
    assert media.allowed_domains == {"images.example.com", "cdn.example.org"}
    assert (media.max_bytes, media.allow_private) == (args.max_image_bytes, False)
