"""A request's remote images fetched together (#33, ``fetch_batch``), against a real HTTP
server on loopback: concurrently (an origin that answers only once all three requests have
arrived), at most ``max_in_flight`` at once, under one deadline, the lowest failing part named
whatever the order the failures came in, no fetch left running afterwards, and the fetched
bytes counted with the body against ``--max-request-body-bytes``. Nothing here waits on time:
the origin's handlers wait on barriers and events the test or the client's own actions open."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import select
import socket
import threading
from collections.abc import Coroutine, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import pytest

from tokenwire.server.rest.errors import RestError
from tokenwire.server.rest.fetch_batch import ImageJob, fetch_all
from tokenwire.server.rest.media_fetch import FetchedImage, MediaFetchPolicy
from tokenwire.server.rest.models import ChatCompletionRequest
from tokenwire.server.rest.remote_images import inline_chat_images, inline_response_images
from tokenwire.server.rest.responses_api.models import ResponsesRequest

T = TypeVar("T")
GATED = 3  # /gate/<k> answers once this many of them have arrived


def _image(k: int) -> bytes:
    return b"\x89PNG" + bytes([k]) * (100 + k)


class _Handler(BaseHTTPRequestHandler):
    server: _Origin

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        kind, _, arg = self.path.strip("/").partition("/")
        if kind == "gate":  # every GATED request waits until all of them have arrived
            self.server.in_flight.append(self.path)
            try:
                self.server.gate.wait()
            except threading.BrokenBarrierError:
                return
            self._send(200, _image(int(arg)))
        elif kind == "size":
            self._send(200, b"z" * int(arg))
        elif kind == "hang":  # nothing is sent; the handler ends when the client hangs up
            self.server.arrived.release()
            self.server.hang_arrived.set()
            if self._wait_closed():
                self.server.closed.release()
        elif kind == "redirect":  # a refusal (once a /hang is in); then tells /after-redirect
            self.server.hang_arrived.wait()
            self._send(302, b"", {"location": "/size/1"})
            if self._wait_closed():
                self.server.redirect_done.set()
        elif kind == "after-redirect":  # a different refusal, only after /redirect's
            self.server.redirect_done.wait()
            self._send(404, b"no")

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in {"content-type": "image/png", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def _wait_closed(self) -> bool:
        """Whether the client closed the connection (False: the test is over first)."""
        while not self.server.release.is_set():
            readable, _, _ = select.select([self.connection], [], [], 0.05)
            if readable:
                try:
                    peeked: bytes = self.connection.recv(1, socket.MSG_PEEK)
                except OSError:
                    return True
                return peeked == b""
        return False


class _Origin(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.gate = threading.Barrier(GATED)
        self.in_flight: list[str] = []  # the /gate paths that arrived
        self.arrived = threading.Semaphore(0)  # a /hang request arrived
        self.closed = threading.Semaphore(0)  # a /hang request's client hung up
        self.redirect_done = threading.Event()  # /redirect's client hung up
        self.hang_arrived = threading.Event()
        self.release = threading.Event()  # the test is over: every handler ends

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def origin() -> Iterator[_Origin]:
    """A fresh origin per test: a barrier a failed test left half-passed stays with it."""
    server = _Origin()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.gate.abort()
    server.redirect_done.set()
    server.hang_arrived.set()
    server.shutdown()
    server.server_close()
    thread.join()


def _policy(timeout: float = 30.0, **fields: Any) -> MediaFetchPolicy:
    base = MediaFetchPolicy(frozenset({"127.0.0.1"}), 4096, timeout, allow_private=True)
    return dataclasses.replace(base, **fields)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """``coro`` run to its end; then no other task may be left on the loop, except the loop's
    own closing of an async generator that a cancelled fetch dropped inside httpx (Python
    schedules ``aclose()`` of a collected generator as a task: ``async_generator_athrow``)."""

    async def main() -> T:
        try:
            return await coro
        finally:
            left = asyncio.all_tasks() - {asyncio.current_task()}
            assert [t for t in left if "async_generator_athrow" not in repr(t)] == []

    return asyncio.run(main())


def _refused(coro: Coroutine[Any, Any, object]) -> RestError:
    with pytest.raises(RestError) as info:
        _run(coro)
    assert info.value.status == 400
    return info.value


def _decoded(data_url: str) -> bytes:
    head, _, payload = data_url.partition(",")
    assert head == "data:image/png;base64"
    return base64.b64decode(payload)


def test_chat_images_are_fetched_at_once_and_land_in_their_parts(origin: _Origin) -> None:
    """Each /gate answers only when all three have arrived: one after another, the first
    would wait for the others until the deadline."""
    text = {"type": "text", "text": "look"}

    def image(k: int) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": f"{origin.url}/gate/{k}"}}

    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [text, image(0), text, image(1)]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [image(2)]},
            ],
        }
    )
    out = _run(inline_chat_images(body, _policy()))
    parts = [m.content for m in out.messages]
    assert [p.type for p in parts[0]] == ["text", "image_url", "text", "image_url"]  # type: ignore[union-attr]
    assert _decoded(parts[0][1].image_url.url) == _image(0)  # type: ignore[index,union-attr]
    assert _decoded(parts[0][3].image_url.url) == _image(1)  # type: ignore[index,union-attr]
    assert parts[1] == "ok"
    assert _decoded(parts[2][0].image_url.url) == _image(2)  # type: ignore[index,union-attr]
    assert sorted(origin.in_flight) == [f"/gate/{k}" for k in range(GATED)]


def test_responses_images_are_fetched_at_once_too(origin: _Origin) -> None:
    def image(k: int) -> dict[str, Any]:
        return {"type": "input_image", "image_url": f"{origin.url}/gate/{k}"}

    body = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}, image(0)]},
                {"type": "function_call_output", "call_id": "c", "output": [image(1), image(2)]},
            ],
        }
    )
    out = _run(inline_response_images(body, _policy()))
    assert not isinstance(out.input, str)
    content, output = out.input[0].content, out.input[1].output  # type: ignore[union-attr]
    assert _decoded(content[1].image_url) == _image(0)  # type: ignore[index,union-attr,arg-type]
    assert [_decoded(p.image_url) for p in output] == [_image(1), _image(2)]  # type: ignore[union-attr,arg-type]


def test_at_most_max_in_flight_are_fetched_at_once(origin: _Origin) -> None:
    """Two at once: the third /gate never arrives while the first two wait for it, so the
    deadline passes, naming the first part."""
    jobs = [ImageJob(f"messages.0.content.{k}", f"{origin.url}/gate/{k}") for k in range(3)]
    error = _refused(fetch_all(jobs, _policy(timeout=1.0, max_in_flight=2)))
    assert (error.param, error.message) == (
        "messages.0.content.0",
        "fetching the request's image URLs took over 1s",
    )
    assert "/gate/2" not in origin.in_flight


def test_one_deadline_for_the_whole_request(origin: _Origin) -> None:
    """Three URLs that never answer: one refusal after the one deadline, naming the first;
    every connection is closed (the origin sees each client hang up) and no task is left."""
    jobs = [ImageJob(f"input.{k}.content.0", f"{origin.url}/hang") for k in range(3)]
    error = _refused(fetch_all(jobs, _policy(timeout=1.0)))
    assert (error.param, error.message) == (
        "input.0.content.0",
        "fetching the request's image URLs took over 1s",
    )
    # Each request the origin got (all three, but for a box too loaded to send one in 1 s)
    # was hung up on.
    arrived = sum(origin.arrived.acquire(blocking=False) for _ in jobs)
    for _ in range(arrived):
        assert origin.closed.acquire(timeout=30)


def test_the_lowest_failing_part_is_named_whatever_failed_first(origin: _Origin) -> None:
    """Part 2 is refused first (a redirect, sent once part 3 is in); part 0 answers 404 only
    after part 2's client hung up, and is the one named. Part 3, which hangs, is cancelled at
    part 2's failure (its client hangs up long before the deadline)."""
    urls = ["after-redirect", "size/10", "redirect", "hang"]
    jobs = [ImageJob(f"messages.1.content.{k}", f"{origin.url}/{u}") for k, u in enumerate(urls)]
    error = _refused(fetch_all(jobs, _policy(timeout=30.0)))
    assert (error.param, error.message) == (
        "messages.1.content.0",
        "the image URL answered HTTP 404",
    )
    assert origin.redirect_done.is_set()
    assert origin.closed.acquire(timeout=30)
    # Part 2 alone failing is named itself; the parts around it do not matter.
    jobs[0] = ImageJob("messages.1.content.0", f"{origin.url}/size/5")
    error = _refused(fetch_all(jobs, _policy(timeout=30.0)))
    assert error.param == "messages.1.content.2" and "redirects (302)" in error.message


def test_a_refused_host_is_named_in_order_too(origin: _Origin) -> None:
    """A host not listed is refused at once, yet a part before it that fails later wins."""
    refused = ImageJob("messages.0.content.1", "http://example.com/x.png")
    ok = ImageJob("messages.0.content.0", f"{origin.url}/size/3")
    error = _refused(fetch_all([ok, refused], _policy()))
    assert error.param == "messages.0.content.1"
    assert "not in --allowed-media-domains" in error.message
    moved = ImageJob("messages.0.content.0", f"{origin.url}/redirect")
    origin.hang_arrived.set()
    error = _refused(fetch_all([moved, refused], _policy()))
    assert error.param == "messages.0.content.0" and "redirects (302)" in error.message


@pytest.mark.parametrize(
    ("body_bytes", "limit", "crossed"),
    [
        (0, 6000, None),  # 3000 + 3000: at the limit is fine
        (0, 5999, "messages.0.content.1"),  # the second image crosses it
        (1000, 3999, "messages.0.content.0"),  # body + the first already does
        (1000, 7000, None),
    ],
)
def test_fetched_bytes_count_with_the_body(
    origin: _Origin, body_bytes: int, limit: int, crossed: str | None
) -> None:
    """Two images each under --max-image-bytes (4096) whose sum with the body passes the
    request limit: the part named is the first whose running sum in part order passes it,
    whichever image arrived first."""
    jobs = [ImageJob(f"messages.0.content.{k}", f"{origin.url}/size/3000") for k in range(2)]
    policy = _policy(max_request_bytes=limit)
    if crossed is None:
        images = _run(fetch_all(jobs, policy, body_bytes))
        assert images == [FetchedImage(b"z" * 3000, "image/png")] * 2
        return
    error = _refused(fetch_all(jobs, policy, body_bytes))
    assert error.param == crossed
    assert f"over {limit} bytes (--max-request-body-bytes)" in error.message


def test_max_in_flight_is_at_least_one() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        MediaFetchPolicy(max_in_flight=0)
