"""The ``SessionResponse`` messages a Session sends: turn events built from engine output,
in-band turn errors and notices."""

from __future__ import annotations

from tokenwire.runtime.outputs import ChoiceDelta, RequestOutput, RequestStarted
from tokenwire.server.grpc import convert
from tokenwire.server.grpc.errors import ServiceError, to_status_proto
from tokenwire.v1 import generation_pb2 as pb


def notice(kind: pb.NoticeKind, message: str) -> pb.SessionResponse:
    return pb.SessionResponse(notice=pb.SessionNotice(kind=kind, message=message))


def turn_started(number: int, session_id: str, item: RequestStarted) -> pb.SessionResponse:
    return pb.SessionResponse(
        turn_started=pb.TurnStarted(
            turn=number,
            request_id=f"{session_id}/turn-{number}",
            prompt_tokens=item.num_prompt_tokens,
            cached_tokens=item.num_cached_tokens,
        )
    )


def turn_delta(number: int, item: ChoiceDelta, num_top: int | None) -> pb.SessionResponse:
    return pb.SessionResponse(
        delta=pb.TurnDelta(turn=number, delta=convert.token_delta(item, num_top))
    )


def turn_ends(number: int, output: RequestOutput) -> list[pb.SessionResponse]:
    """One ``TurnEnd`` per choice of the finished turn."""
    usage = convert.usage(output)
    return [
        pb.SessionResponse(
            turn_end=pb.TurnEnd(
                turn=number,
                index=c.index,
                finish_reason=convert.finish_reason(c.finish_reason),
                usage=usage,
                **convert.stop_fields(c.stop_reason),
            )
        )
        for c in output.outputs
    ]


def turn_error(number: int, err: ServiceError) -> pb.SessionResponse:
    """A turn that failed: its ``TurnEnd`` carries the error and the session goes on."""
    return pb.SessionResponse(
        turn_end=pb.TurnEnd(
            turn=number,
            finish_reason=convert.finish_reason(None),
            error=to_status_proto(err),
        )
    )
