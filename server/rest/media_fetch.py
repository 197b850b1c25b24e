"""Fetch a remote image (``--allowed-media-domains``), never from a private address.

A URL is fetched only when its scheme is ``http`` or ``https`` and its host is in the
allow-list: an exact, case-insensitive match of the whole host name (``example.com`` does not
allow ``cdn.example.com``; list each host). The host is resolved off the event loop
(``loop.getaddrinfo``) and refused if ANY address it resolves to is private, loopback,
link-local, multicast, reserved or unspecified (IPv4-mapped IPv6 addresses are judged by
their IPv4 address). The connection then goes to a checked address itself (the IP in the
URL, the ``Host`` header and TLS SNI / certificate check kept on the host name; the next
checked address only when one cannot be connected to), so no second DNS lookup can swap in
another address. No proxy from the environment is used, no redirect
is followed, the whole fetch has a timeout, and the body is read streaming and cut at
``max_bytes`` (``--max-image-bytes``). Every refusal is a 400 naming the part.

A request's images go through ``fetch_batch`` (``fetch_checked`` each, concurrently, under one
deadline for them all, each chunk counted against the request's ``max_request_bytes``);
``fetch_image`` fetches one URL under its own deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import ssl
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from typing import cast

import httpx

from tokenwire.server.rest.errors import RestError, invalid

FLAG = "--allowed-media-domains"
_IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# Told each chunk's size as it is read; it may raise to stop the fetch (``fetch_batch``).
ByteCounter = Callable[[int], None]


def _uncounted(size: int) -> None:
    pass


@dataclass(frozen=True)
class MediaFetchPolicy:
    """Which remote image URLs the REST shim fetches, and how much of them."""

    allowed_domains: frozenset[str] = frozenset()  # lower-case host names; empty: fetch none
    max_bytes: int = 10 << 20  # the body is cut (and refused) past this many bytes
    # Seconds for all of one request's fetches: resolve, connect, read (one deadline).
    timeout: float = 10.0
    # Tests only (no flag sets it): permit private / loopback addresses, so a test server on
    # 127.0.0.1 can serve the positive path.
    allow_private: bool = False
    # Tests only: the CA to verify https origins against (default: the system's).
    verify: ssl.SSLContext | bool = True
    # The fetched bytes of one request's images plus its body may not pass this
    # (``--max-request-body-bytes``: ``create_app`` sets it); None: no request-wide bound.
    max_request_bytes: int | None = None
    max_in_flight: int = 4  # one request's images fetched at once, at most

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")

    @staticmethod
    def of(domains: Iterable[str] | None, max_bytes: int) -> MediaFetchPolicy:
        """The policy of ``--allowed-media-domains`` and ``--max-image-bytes``."""
        hosts = frozenset(d.strip().lower().rstrip(".") for d in domains or ())
        if "" in hosts:
            raise ValueError(f"{FLAG}: an empty host name")
        if max_bytes <= 0:
            raise ValueError("--max-image-bytes must be > 0")
        return MediaFetchPolicy(hosts, max_bytes)

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_domains)


@dataclass(frozen=True)
class FetchedImage:
    data: bytes
    mime_type: str  # the response's image/* Content-Type, or "" (the server sniffs)


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def forbidden_address(ip: _IpAddress) -> bool:
    """Private, loopback, link-local, multicast, reserved or unspecified (any form)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or not ip.is_global
    )


def checked_url(url: str, policy: MediaFetchPolicy, param: str) -> httpx.URL:
    """``url`` parsed, if its scheme is http(s) and its host is allowed; else a 400."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError):
        raise invalid(param, "the image URL does not parse") from None
    if parsed.scheme not in ("http", "https"):
        raise invalid(param, "a remote image URL must be http:// or https://")
    host = parsed.host.lower().rstrip(".")
    if not host or host not in policy.allowed_domains:
        raise invalid(
            param,
            f"the image URL's host {host!r} is not in {FLAG} (exact host names)",
            "unsupported_value",
        )
    if parsed.userinfo:
        raise invalid(param, "an image URL may not carry user:password@")
    return parsed


async def resolve_checked(host: str, port: int, policy: MediaFetchPolicy, param: str) -> list[str]:
    """The addresses of ``host`` (resolver order, each once), after checking every one."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise invalid(param, f"the image URL's host {host!r} does not resolve") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not addresses:
        raise invalid(param, f"the image URL's host {host!r} does not resolve")
    if not policy.allow_private:
        bad = [str(ip) for ip in addresses if forbidden_address(ip)]
        if bad:
            raise invalid(
                param,
                f"the image URL's host {host!r} resolves to a private or reserved address "
                f"({bad[0]}); it is not fetched",
                "unsupported_value",
            )
    return list(dict.fromkeys(str(ip) for ip in addresses))


async def fetch_image(url: str, policy: MediaFetchPolicy, param: str) -> FetchedImage:
    """The image at ``url`` under ``policy``; a 400 naming ``param`` for any refusal."""
    parsed = checked_url(url, policy, param)
    try:
        async with asyncio.timeout(policy.timeout):
            return await fetch_checked(parsed, policy, param)
    except TimeoutError:
        raise invalid(param, f"fetching the image URL took over {policy.timeout:g}s") from None


async def fetch_checked(
    parsed: httpx.URL, policy: MediaFetchPolicy, param: str, count: ByteCounter = _uncounted
) -> FetchedImage:
    """GET ``parsed`` (a ``checked_url``) from its checked addresses in turn (the next only if
    one cannot be connected to), each pinned: the IP in the URL, ``Host`` and SNI the URL's
    host. No deadline of its own (the caller's); ``count`` is told each chunk read."""
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    addresses = await resolve_checked(parsed.host, port, policy, param)
    host_header = parsed.netloc.decode("ascii").rsplit("@", 1)[-1]
    headers = {"host": host_header, "accept": "image/*", "accept-encoding": "identity"}
    extensions = {"sni_hostname": parsed.host} if parsed.scheme == "https" else {}
    failure = "ConnectError"
    async with httpx.AsyncClient(
        trust_env=False, follow_redirects=False, timeout=None, verify=policy.verify
    ) as client:
        for address in addresses:
            pinned = parsed.copy_with(host=address)
            request = client.build_request("GET", pinned, headers=headers, extensions=extensions)
            try:
                response = await client.send(request, stream=True)
            except httpx.ConnectError as exc:
                failure = f"ConnectError: {exc}" if "CERTIFICATE" in str(exc) else failure
                continue
            except httpx.HTTPError as exc:
                raise invalid(
                    param, f"fetching the image URL failed ({type(exc).__name__})"
                ) from None
            try:
                return await _read(response, policy, param, count)
            except httpx.HTTPError as exc:
                raise invalid(
                    param, f"reading the image URL failed ({type(exc).__name__})"
                ) from None
            finally:
                await response.aclose()
    raise invalid(param, f"fetching the image URL failed ({failure})")


async def _read(
    response: httpx.Response, policy: MediaFetchPolicy, param: str, count: ByteCounter
) -> FetchedImage:
    """The body, refused on a non-2xx status or past ``max_bytes`` (nothing read past it)."""
    if response.is_redirect or 300 <= response.status_code < 400:
        raise invalid(param, f"the image URL redirects ({response.status_code}); not followed")
    if not response.is_success:
        raise invalid(param, f"the image URL answered HTTP {response.status_code}")
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise invalid(param, f"the image URL's content-encoding {encoding!r} is not accepted")
    too_big = _too_big(param, policy.max_bytes)
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > policy.max_bytes:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    # Closed here even when a check raises mid-body: an abandoned async generator would be
    # closed later by a task of the event loop's own, outliving the fetch.
    raw = cast(AsyncGenerator[bytes, None], response.aiter_raw())  # an async generator
    async with contextlib.aclosing(raw) as body:
        async for chunk in body:
            size += len(chunk)
            if size > policy.max_bytes:
                raise too_big
            count(len(chunk))
            chunks.append(chunk)
    mime = response.headers.get("content-type", "").split(";")[0].strip().lower()
    return FetchedImage(b"".join(chunks), mime if mime.startswith("image/") else "")


def _too_big(param: str, limit: int) -> RestError:
    return invalid(param, f"the image at the URL is over {limit} bytes (--max-image-bytes)")


__all__ = [
    "FLAG",
    "ByteCounter",
    "FetchedImage",
    "MediaFetchPolicy",
    "checked_url",
    "fetch_checked",
    "fetch_image",
    "forbidden_address",
    "is_remote",
    "resolve_checked",
]
