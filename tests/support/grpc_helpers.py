"""Helpers shared by the gRPC server tests: an engine observer that records steps, a gate
that parks the engine core (thread or process) at a chosen step, a spy for engine methods,
request builders and error-detail readers. Synchronisation is by events, never by sleeping."""

from __future__ import annotations

import json
import multiprocessing
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tokenwire.runtime.stats import RequestStats, StepRecorder, StepStats
from tokenwire.v1 import common_pb2, generation_pb2


@dataclass(frozen=True)
class ParkedStep:
    """What the core's step looked like where the gate parked it."""

    step_id: int
    scheduled: dict[str, int]
    prefill_req_ids: frozenset[str]
    num_waiting: int


class CoreGate:
    """A core-side observer that parks the engine core at the n-th step serving a request
    whose id contains a needle, until released. Built on multiprocessing primitives of the
    spawn context, so the same object works on the core thread and, handed to the core
    process when it is spawned, in the core process."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._needle = ctx.Array("c", 512)  # empty: disarmed
        self._nth = ctx.Value("i", 0)
        self._seen = ctx.Value("i", 0)
        self._parked_step = ctx.Array("c", 1 << 16)  # JSON of the parked step
        self.parked = ctx.Event()
        self._release = ctx.Event()

    def arm(self, needle: str, nth: int) -> None:
        self.parked.clear()
        self._release.clear()
        self._nth.value, self._seen.value = nth, 0
        self._needle.value = needle.encode()

    def release(self) -> None:
        self._needle.value = b""
        self._release.set()

    @property
    def parked_at(self) -> ParkedStep | None:
        raw = self._parked_step.value
        if not raw:
            return None
        data = json.loads(raw)
        return ParkedStep(
            data["step_id"], data["scheduled"], frozenset(data["prefill"]), data["waiting"]
        )

    def on_step(self, stats: StepStats) -> None:
        needle = self._needle.value.decode()
        if not needle:
            return
        self._seen.value += any(needle in rid for rid in stats.scheduled)
        if self._seen.value < self._nth.value:
            return
        self._needle.value = b""
        self._parked_step.value = json.dumps(
            {
                "step_id": stats.step_id,
                "scheduled": stats.scheduled,
                "prefill": sorted(stats.prefill_req_ids),
                "waiting": stats.num_waiting,
            }
        ).encode()
        self.parked.set()
        self._release.wait(30)

    def on_request_finished(self, stats: RequestStats) -> None:
        pass


class Recorder(StepRecorder):
    """The step recorder (``StepRecorder``: every step and finished request, as the front
    receives them from the core) plus a ``gate``, handed to the engine as its core observer,
    that parks the core at the n-th step serving a request whose id contains ``needle``
    (``hold``) until ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = CoreGate()

    @property
    def parked(self) -> Any:
        return self.gate.parked

    @property
    def parked_at(self) -> ParkedStep | None:
        return self.gate.parked_at

    def hold(self, needle: str, nth: int = 2) -> None:
        self.gate.arm(needle, nth)

    def release(self) -> None:
        self.gate.release()


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
