"""Helpers shared by the gRPC server tests: an engine observer that records steps and can
park the engine thread at a chosen step, a spy for engine methods, request builders and
error-detail readers. Synchronisation is by events, never by sleeping."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tokenwire.runtime.stats import RequestStats, StepStats
from tokenwire.v1 import common_pb2, generation_pb2


class Recorder:
    """Engine observer: records every step and finished request, and on request parks the
    engine thread at the n-th step serving a request whose id contains ``needle`` (until
    ``release``). While parked, the engine state may be read from the test thread."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.finished: dict[str, RequestStats] = {}
        self._match: Callable[[StepStats], bool] | None = None
        self._release = threading.Event()
        self.parked = threading.Event()
        self.parked_at: StepStats | None = None

    def hold(self, needle: str, nth: int = 2) -> None:
        seen = [0]

        def match(stats: StepStats) -> bool:
            seen[0] += any(needle in rid for rid in stats.scheduled)
            return seen[0] >= nth

        self.parked, self._release = threading.Event(), threading.Event()
        self._match = match

    def release(self) -> None:
        self._match = None
        self._release.set()

    def on_step(self, stats: StepStats) -> None:
        self.steps.append(stats)
        if self._match is not None and self._match(stats):
            self._match, self.parked_at = None, stats
            self.parked.set()
            self._release.wait(30)

    def on_request_finished(self, stats: RequestStats) -> None:
        self.finished[stats.request_id] = stats

    def steps_of(self, request_id: str) -> list[StepStats]:
        return [s for s in self.steps if request_id in s.scheduled]


class Spy:
    """Wraps a method and records the first argument of every call (any thread)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls: list[Any] = []
        self.cond = threading.Condition()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.fn(*args, **kwargs)
        with self.cond:
            self.calls.append(args[0])
            self.cond.notify_all()
        return result

    def wait(self, needle: str, timeout: float = 10.0) -> None:
        """Block until a call's first argument contains ``needle``."""
        with self.cond:
            assert self.cond.wait_for(lambda: any(needle in c for c in self.calls), timeout), (
                f"no call with {needle!r}: {self.calls}"
            )


def spy_on(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str) -> Spy:
    spy = Spy(getattr(obj, name))
    monkeypatch.setattr(obj, name, spy)
    return spy


def greedy_request(
    ids: list[int], max_tokens: int, request_id: str = "", **sampling: Any
) -> generation_pb2.GenerateRequest:
    """A token-ids request; greedy unless ``sampling`` says otherwise, EOS ignored."""
    sampling.setdefault("temperature", 0.0)
    return generation_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        request_id=request_id,
        sampling=common_pb2.SamplingOptions(**sampling),
        stopping=common_pb2.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
    )


def delta_ids(events: Any) -> list[int]:
    """Token ids of all TokenDelta events (any choice) of a GenerateStream, in order."""
    return [t for e in events if e.HasField("delta") for t in e.delta.token_ids]


def details_of(err: grpc.RpcError) -> tuple[error_details_pb2.ErrorInfo | None, list[Any]]:
    """The ErrorInfo (or None) and all google.rpc.Status details of a failed call."""
    status = rpc_status.from_call(err)
    details = list(status.details) if status is not None else []
    for detail in details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            assert info.domain == "tokenwire"
            return info, details
    return None, details
