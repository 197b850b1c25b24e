"""The soak's callers: each call is one kind (unary, stream, session, REST stream) in one mode
(complete, cancel, deadline, disconnect, bad), picked by a seeded RNG, and ends in an outcome
the caller records. A call whose outcome is not one its mode allows is recorded as
``unexpected:<what happened>``; the soak fails on any of those."""

from __future__ import annotations

import queue
import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx

from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pb = generation_pb2
MODES = ("cancel", "deadline", "disconnect", "bad", "complete")
# A third of the calls are cancelled; the rest split between the other modes.
WEIGHTS = (0.34, 0.1, 0.1, 0.08, 0.38)
CALL_TIMEOUT = 60.0  # no call may take longer: a hang fails the soak as unexpected
LENGTH = common_pb2.FINISH_REASON_LENGTH
CANCELLED = common_pb2.FINISH_REASON_CANCELLED


@dataclass
class Tally:
    """Thread-safe counts of (kind, mode, outcome)."""

    counts: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, mode: str, outcome: str) -> None:
        with self.lock:
            self.counts[(kind, mode, outcome)] += 1

    def by(self, index: int) -> Counter[str]:
        out: Counter[str] = Counter()
        for key, n in self.counts.items():
            out[key[index]] += n
        return out

    def unexpected(self) -> dict[tuple[str, str, str], int]:
        return {k: n for k, n in self.counts.items() if k[2].startswith("unexpected")}


def request(rng: random.Random, max_tokens: int, bad: bool = False) -> pb.GenerateRequest:
    ids = [rng.randrange(3, 400) for _ in range(rng.randrange(2, 40))]
    sampling = common_pb2.SamplingOptions(temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(9))
    if bad:  # a negative temperature, or a prompt past the context: INVALID_ARGUMENT
        if rng.random() < 0.5:
            sampling = common_pb2.SamplingOptions(temperature=-1.0)
        else:
            ids = [5] * 300
    return pb.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        request_id=f"soak-{rng.getrandbits(48):x}",
        sampling=sampling,
        stopping=common_pb2.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
    )


def _code(exc: grpc.RpcError) -> str:
    return str(exc.code().name)  # type: ignore[attr-defined]


def _expect(mode: str, outcome: str, allowed: tuple[str, ...]) -> str:
    return outcome if outcome in allowed else f"unexpected:{mode}:{outcome}"


# ---------------------------------------------------------------------------- gRPC unary
def unary(rng: random.Random, channel: grpc.Channel, target: str, mode: str) -> str:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    max_tokens = rng.randrange(1, 40)
    req = request(rng, max_tokens, bad=mode == "bad")
    timeout = rng.uniform(0.002, 0.2) if mode == "deadline" else CALL_TIMEOUT
    own = grpc.insecure_channel(target) if mode == "disconnect" else None
    call = generation_pb2_grpc.GenerationServiceStub(own).Generate if own else stub.Generate
    future = call.future(req, timeout=timeout)
    if mode in ("cancel", "disconnect"):
        try:
            future.result(timeout=rng.uniform(0.0, 0.15))  # a random point of its life
        except grpc.FutureTimeoutError:
            if own is None:
                future.cancel()
            else:
                own.close()
        except grpc.RpcError:
            pass
    try:
        reply = future.result(timeout=CALL_TIMEOUT)
        done = len(reply.choices[0].token_ids) == max_tokens
        outcome = "ok" if done else "short"
    except grpc.FutureCancelledError:
        outcome = "CANCELLED"
    except grpc.RpcError as exc:
        outcome = _code(exc)
    finally:
        if own is not None:
            own.close()
    allowed = {
        "complete": ("ok",),
        "cancel": ("ok", "CANCELLED"),
        "deadline": ("ok", "DEADLINE_EXCEEDED"),
        "disconnect": ("ok", "CANCELLED"),
        "bad": ("INVALID_ARGUMENT",),
    }[mode]
    return _expect(mode, outcome, allowed)


# ---------------------------------------------------------------------------- gRPC stream
def stream(rng: random.Random, channel: grpc.Channel, target: str, mode: str) -> str:
    max_tokens = rng.randrange(1, 60)
    req = request(rng, max_tokens, bad=mode == "bad")
    timeout = rng.uniform(0.002, 0.2) if mode == "deadline" else CALL_TIMEOUT
    own = grpc.insecure_channel(target) if mode == "disconnect" else None
    stub = generation_pb2_grpc.GenerationServiceStub(own or channel)
    call = stub.GenerateStream(req, timeout=timeout)
    stop_after = rng.randrange(1, max_tokens + 3)  # events: start, deltas, end(s), usage
    by_rpc = mode == "cancel" and rng.random() < 0.5  # the Cancel RPC instead of call.cancel()
    tokens, ends, seen = 0, [], 0
    try:
        for event in call:
            seen += 1
            tokens += len(event.delta.token_ids) if event.HasField("delta") else 0
            if event.HasField("end"):
                ends.append(event.end)
            if seen == stop_after and mode in ("cancel", "disconnect"):
                if by_rpc:
                    stub.Cancel(pb.CancelRequest(request_id=req.request_id), timeout=CALL_TIMEOUT)
                elif mode == "cancel":
                    call.cancel()
                else:
                    own.close()  # type: ignore[union-attr]
        ok = [e.finish_reason for e in ends] == [LENGTH] and tokens == max_tokens
        cancelled = [e.finish_reason for e in ends] == [CANCELLED] and tokens <= max_tokens
        outcome = "ok" if ok else ("cancelled_by_rpc" if cancelled and by_rpc else "short")
    except grpc.RpcError as exc:
        outcome = _code(exc)
    finally:
        if own is not None:
            own.close()
    allowed = {
        "complete": ("ok",),
        "cancel": ("ok", "cancelled_by_rpc") if by_rpc else ("ok", "CANCELLED"),
        "deadline": ("ok", "DEADLINE_EXCEEDED"),
        "disconnect": ("ok", "CANCELLED"),
        "bad": ("INVALID_ARGUMENT",),
    }[mode]
    return _expect(mode, outcome, allowed)


# ---------------------------------------------------------------------------- sessions
def session(rng: random.Random, channel: grpc.Channel, target: str, mode: str) -> str:
    """Open, 1-3 turns, Close. cancel: CancelTurn (or the whole call) mid-turn; bad: one
    turn fails in-band with INVALID_ARGUMENT and the session goes on."""
    outbox: queue.Queue[pb.SessionRequest | None] = queue.Queue()
    own = grpc.insecure_channel(target) if mode == "disconnect" else None
    stub = generation_pb2_grpc.GenerationServiceStub(own or channel)
    timeout = rng.uniform(0.01, 0.3) if mode == "deadline" else CALL_TIMEOUT
    call = stub.Session(iter(outbox.get, None), timeout=timeout)
    stopping = common_pb2.StoppingOptions(max_tokens=rng.randrange(1, 16), ignore_eos=True)
    sampling = common_pb2.SamplingOptions(temperature=0.0)
    outbox.put(pb.SessionRequest(open=pb.SessionOpen(sampling=sampling, stopping=stopping)))
    turns, bad_turn = rng.randrange(1, 4), rng.randrange(3)
    cut = (rng.randrange(turns), rng.randrange(1, 6))  # (turn, event) where a fault strikes
    whole_call = rng.random() < 0.5
    outcome = "ok"
    try:
        assert next(call).HasField("opened")
        for turn in range(turns):
            ids = [rng.randrange(3, 400) for _ in range(rng.randrange(1, 12))]
            options: dict[str, Any] = {}
            if mode == "bad" and turn == bad_turn % turns:
                options["sampling"] = common_pb2.SamplingOptions(temperature=-2.0)
            turn_msg = pb.SessionTurn(token_ids=common_pb2.TokenIds(ids=ids), **options)
            outbox.put(pb.SessionRequest(turn=turn_msg))
            outcome = _session_turn(call, outbox, own, mode, turn, cut, whole_call, outcome)
        outbox.put(pb.SessionRequest(close=pb.SessionClose()))
        for extra in call:
            kind = extra.WhichOneof("message")
            assert kind == "notice", f"unexpected {kind} after Close"
    except grpc.RpcError as exc:
        outcome = _code(exc)
    finally:
        outbox.put(None)  # unblocks gRPC's request-iterator thread whatever happened
        if own is not None:
            own.close()
    allowed = {
        "complete": ("ok",),
        "cancel": ("ok", "turn_cancelled", "CANCELLED"),
        "deadline": ("ok", "DEADLINE_EXCEEDED"),
        "disconnect": ("ok", "CANCELLED"),
        "bad": ("turn_invalid",),
    }[mode]
    return _expect(mode, outcome, allowed)


def _session_turn(
    call: Any,
    outbox: queue.Queue[pb.SessionRequest | None],
    own: grpc.Channel | None,
    mode: str,
    turn: int,
    cut: tuple[int, int],
    whole_call: bool,
    outcome: str,
) -> str:
    """Read one turn to its TurnEnd; strike the mode's fault at ``cut``."""
    seen = 0
    for message in call:
        seen += 1
        kind = message.WhichOneof("message")
        if (turn, seen) == cut and mode == "cancel" and not whole_call:
            outbox.put(pb.SessionRequest(cancel_turn=pb.SessionCancelTurn()))
        elif (turn, seen) == cut and mode == "cancel":
            call.cancel()
        elif (turn, seen) == cut and mode == "disconnect":
            assert own is not None
            own.close()
        if kind != "turn_end":
            continue
        end = message.turn_end
        if end.HasField("error"):
            return (
                "turn_invalid"
                if end.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                else (f"turn_error_{end.error.code}")
            )
        if end.finish_reason == CANCELLED:
            return "turn_cancelled"
        return outcome if end.finish_reason == LENGTH else f"turn_end_{end.finish_reason}"
    return "session_ended_mid_turn"


# ---------------------------------------------------------------------------- REST stream
def rest_stream(
    rng: random.Random, http: httpx.Client, base_url: str, model: str, mode: str
) -> str:
    max_tokens = rng.randrange(1, 40)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True}
    body["ignore_eos"] = True
    if rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", [rng.randrange(3, 400) for _ in range(8)]
    else:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"tell me about {rng.random()}"}]
    if mode == "bad":
        body["temperature"] = -1.0
    own = httpx.Client(base_url=base_url) if mode == "disconnect" else None
    timeout = httpx.Timeout(
        CALL_TIMEOUT, read=rng.uniform(0.002, 0.05) if mode == "deadline" else CALL_TIMEOUT
    )
    stop_after = rng.randrange(1, max_tokens + 2)
    lines, outcome = 0, "ok"
    try:
        with (own or http).stream("POST", path, json=body, timeout=timeout) as reply:
            if reply.status_code != 200:
                reply.read()
                outcome = str(reply.status_code)
            else:
                for line in reply.iter_lines():
                    if not line:
                        continue
                    lines += 1
                    if '"error"' in line:
                        outcome = "in_band_error"
                    if lines == stop_after and mode in ("cancel", "disconnect"):
                        outcome = "closed"
                        break  # leaving the block closes the response (and the connection)
                    if line == "data: [DONE]":
                        break
                else:
                    outcome = "no_done" if outcome == "ok" else outcome
    except httpx.ReadTimeout:
        outcome = "timeout"
    finally:
        if own is not None:
            own.close()
    allowed = {
        "complete": ("ok",),
        "cancel": ("ok", "closed"),
        "deadline": ("ok", "timeout"),
        "disconnect": ("ok", "closed"),
        "bad": ("400",),
    }[mode]
    return _expect(mode, outcome, allowed)
