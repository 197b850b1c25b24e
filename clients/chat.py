"""``tokenwire chat``: an interactive terminal chat over one gRPC Session.

Tokens are printed as they stream. Ctrl-C during an answer cancels that turn (CancelTurn) and
keeps the conversation; Ctrl-C or Ctrl-D at the prompt exits. After each turn a dim line shows
TTFT, tokens/s and how many prompt tokens came from the session's KV cache.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, TextIO

from tokenwire.clients import results as r
from tokenwire.clients.channel import TlsOptions, add_tls_client_arguments, tls_from_args
from tokenwire.clients.client import DEFAULT_TARGET, Client
from tokenwire.clients.errors import TokenwireError
from tokenwire.clients.sync_session import SyncSession

_EXIT_COMMANDS = ("/exit", "/quit")


@dataclass(frozen=True)
class TurnStats:
    """What the stats line after a turn reports."""

    ttft_s: float | None
    completion_tokens: int
    tokens_per_s: float | None
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str

    def render(self) -> str:
        ttft = f"TTFT {self.ttft_s * 1000:.0f} ms" if self.ttft_s is not None else "TTFT -"
        rate = f"{self.tokens_per_s:.1f} tok/s" if self.tokens_per_s is not None else "- tok/s"
        cache = f"cache {self.cached_tokens}/{self.prompt_tokens} prompt tokens"
        parts = [ttft, rate, f"{self.completion_tokens} tokens", cache, self.finish_reason]
        return " · ".join(parts)


class TurnMeter:
    """Timestamps and counts of one turn, fed with its events."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.end: float | None = None
        self.started: r.TurnStart | None = None
        self.finished: r.TurnEnd | None = None
        self.token_count = 0

    def observe(self, event: r.SessionEvent) -> None:
        now = time.perf_counter()
        if isinstance(event, r.TurnStart):
            self.started = event
        elif isinstance(event, r.TextDelta) and (event.token_ids or event.text):
            self.first = self.first if self.first is not None else now
            self.token_count += len(event.token_ids)
        elif isinstance(event, r.TurnEnd):
            self.finished, self.end = event, now

    def stats(self) -> TurnStats:
        end = self.end if self.end is not None else time.perf_counter()
        usage = self.finished.usage if self.finished else r.Usage()
        tokens = max(usage.completion_tokens, self.token_count)
        rate = None
        if self.first is not None and tokens > 1 and end > self.first:
            rate = (tokens - 1) / (end - self.first)  # decode rate after the first token
        elif tokens and end > self.start:
            rate = tokens / (end - self.start)
        return TurnStats(
            ttft_s=None if self.first is None else self.first - self.start,
            completion_tokens=tokens,
            tokens_per_s=rate,
            prompt_tokens=self.started.prompt_tokens if self.started else usage.prompt_tokens,
            cached_tokens=self.started.cached_tokens if self.started else usage.cached_tokens,
            finish_reason=self.finished.finish_reason if self.finished else "unfinished",
        )


def _dim(text: str, out: TextIO) -> str:
    return f"\x1b[2m{text}\x1b[0m" if out.isatty() else text


@contextlib.contextmanager
def _cancel_on_sigint(session: SyncSession) -> Iterator[None]:
    """While a turn streams, Ctrl-C sends CancelTurn instead of raising KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        session.cancel_turn()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def chat_turn(session: SyncSession, line: str, out: TextIO) -> TurnStats:
    """Send one user message, print its tokens as they arrive, return the turn's stats."""
    meter = TurnMeter()
    with _cancel_on_sigint(session):
        for event in session.send(line):
            meter.observe(event)
            if isinstance(event, r.TextDelta) and event.index == 0:
                out.write(event.text)
                out.flush()
            elif isinstance(event, r.Notice):
                out.write(_dim(f"\n[{event.kind}] {event.message}\n", out))
    out.write("\n")
    return meter.stats()


def _repl(session: SyncSession, input_fn: Callable[[str], str], out: TextIO) -> None:
    while not session.closed:
        try:
            line = input_fn("> ").strip()
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return
        if line in _EXIT_COMMANDS:
            return
        if not line:
            continue
        try:
            stats = chat_turn(session, line, out)
        except TokenwireError as err:  # a failed turn; the session goes on unless it ended
            out.write(f"\nerror: {err}\n")
            continue
        out.write(_dim(stats.render(), out) + "\n")
        out.flush()


def run_chat(
    target: str,
    api_key: str | None,
    model: str,
    system_prompt: str | None,
    max_tokens: int | None,
    temperature: float | None,
    *,
    input_fn: Callable[[str], str] = input,
    out: TextIO | None = None,
    tls: TlsOptions | None = None,
) -> int:
    """Run the REPL over one Session until EOF, Ctrl-C at the prompt or ``/exit``."""
    out = out or sys.stdout
    options: dict[str, Any] = {}
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    if temperature is not None:
        options["temperature"] = temperature
    try:
        with (
            Client(target, api_key=api_key, tls=tls) as client,
            client.session(model, system_prompt, **options) as session,
        ):
            banner = f"{session.info.model} at {target} · Ctrl-C stops an answer, Ctrl-D exits"
            out.write(_dim(banner, out) + "\n")
            _repl(session, input_fn, out)
    except TokenwireError as err:
        print(f"tokenwire chat: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        out.write("\n")
        return 130
    return 0


def _run_from_args(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get("TOKENWIRE_API_KEY") or None
    try:
        tls = tls_from_args(args)
    except ValueError as exc:
        print(f"tokenwire chat: {exc}", file=sys.stderr)
        return 2
    return run_chat(
        args.target, api_key, args.model, args.system, args.max_tokens, args.temperature,
        tls=tls,
    )  # fmt: skip


def add_chat_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``tokenwire chat`` (sets ``func``, which returns the exit status)."""
    p = subparsers.add_parser("chat", help="interactive chat over one gRPC Session")
    p.add_argument("--target", default=DEFAULT_TARGET, help="gRPC server host:port")
    p.add_argument("--api-key", default=None, help="API key (default: $TOKENWIRE_API_KEY)")
    p.add_argument("--model", default="", help="served model name (default: the served one)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=None, help="cap per answer")
    p.add_argument("--temperature", type=float, default=None, help="default: server's")
    add_tls_client_arguments(p)
    p.set_defaults(func=_run_from_args)
