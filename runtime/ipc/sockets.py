"""ZMQ sends that never block: a PUSH socket whose peer is gone (a process exiting, its
socket already closed) would otherwise block the sender forever. With an unlimited
high-water mark a connected peer always takes the message, so only a vanished one drops it;
the receiver's process sentinel reports why."""

from __future__ import annotations

from typing import Any


def send_or_drop(socket: Any, data: bytes) -> bool:
    """Queue ``data`` without blocking; False when no peer can take it."""
    import zmq

    try:
        socket.send(data, zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return False
    return True
