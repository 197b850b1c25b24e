"""Responses over the send limit (``--max-send-message-bytes``): RESOURCE_EXHAUSTED with
ErrorInfo ``RESPONSE_TOO_LARGE``, decided by tokenwire before grpc-core refuses to send them.

grpc-core fails a call whose response is over ``grpc.max_send_message_length`` only after the
handler has returned it: the client gets a bare RESOURCE_EXHAUSTED, the handler's log line and
metrics had already said OK, and grpc logs an ``ExecuteBatchError`` traceback. So handlers
check their responses with ``check_size`` while they can still report the failure (a session
turn in-band), and the decode guard checks every method's answers the same way.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import Message

from tokenwire.server.grpc.errors import ServiceError
from tokenwire.v1 import errors_pb2


def response_too_large(size: int, limit: int) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        errors_pb2.ERROR_REASON_RESPONSE_TOO_LARGE,
        f"the response is {size} bytes, over the server's --max-send-message-bytes "
        f"({limit}); ask for less output (max_tokens, n, logprobs)",
        {"limit": str(limit)},
    )


def check_size(message: Message, limit: int | None) -> None:
    """Raise ``response_too_large`` when ``message`` serializes to more than ``limit`` bytes
    (None: no limit)."""
    if limit is None:
        return
    size = message.ByteSize()
    if size > limit:
        raise response_too_large(size, limit)
