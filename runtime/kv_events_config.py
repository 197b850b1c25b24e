"""``--kv-events-config``: vLLM's JSON keys for publishing KV-cache events.

``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000, "topic": "kv"}``.
The core records events only with ``enable_kv_cache_events``; ``publisher`` "zmq" also starts
the ZMQ PUB (+ ROUTER replay) publisher in the front, "null" feeds only the in-process hub
(the gRPC ``SubscribeKvEvents`` stream). As in vLLM, an endpoint with ``*``, ``::``,
``ipc://`` or ``inproc://`` is bound, any other is connected to.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config enable_kv_cache_events must be true or false")
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config publisher must be one of {', '.join(PUBLISHERS)}, "
                f"got {self.publisher!r}"
            )
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config {name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("kv_events_config replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config {name} must be a whole number >= 1")

    @property
    def publishes_zmq(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def kv_events_config(data: Any) -> KVEventsConfig:
    """From vLLM's JSON object; unknown keys are refused (the message names the key)."""
    if not isinstance(data, dict):
        raise ValueError(f"kv_events_config must be a JSON object, got {data!r:.80}")
    known = {f.name for f in dataclasses.fields(KVEventsConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"kv_events_config has unknown keys {unknown}; known: {sorted(known)}")
    return KVEventsConfig(**data)


def kv_events_from_value(value: Any) -> KVEventsConfig | None:
    """``LLM(kv_events_config={...})``, the flag's JSON text, or the config itself."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    try:
        data = json.loads(value) if isinstance(value, str) else value
        return kv_events_config(data)
    except ValueError as exc:
        raise ValueError(f"--kv-events-config: {exc}") from None


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """argparse ``type`` of ``--kv-events-config``."""
    try:
        data = json.loads(text)
        return kv_events_config(data)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
