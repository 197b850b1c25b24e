"""``--kv-events-config``: vLLM's JSON keys for publishing KV-cache events.

``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000, "topic": "kv"}``.
The core records events only with ``enable_kv_cache_events``; ``publisher`` "zmq" also starts
the ZMQ PUB (+ ROUTER replay) publisher in the front, "null" feeds only the in-process hub
(the gRPC ``SubscribeKvEvents`` stream). As in vLLM, an endpoint with ``*``, ``::``,
``ipc://`` or ``inproc://`` is bound, any other is connected to.

With ``--data-parallel-size N`` each engine core (rank ``r``) publishes on endpoints of its
own, vLLM's ``offset_endpoint_port``: a TCP port plus ``r`` (``tcp://*:5557`` -> rank 1 on
``tcp://*:5558``; an ephemeral ``*`` / ``0`` port stays as it is), an ``ipc://`` or
``inproc://`` name with ``_dp{r}`` appended; the replay endpoint likewise (``for_rank``).
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

    def for_rank(self, rank: int) -> KVEventsConfig:
        """This config with rank ``rank``'s endpoints (rank 0: unchanged)."""
        replay = self.replay_endpoint
        return dataclasses.replace(
            self,
            endpoint=rank_endpoint(self.endpoint, rank),
            replay_endpoint=None if replay is None else rank_endpoint(replay, rank),
        )


def check_rank_endpoints(config: KVEventsConfig, size: int) -> None:
    """``size`` ranks' endpoints: each with a port of its own and no two the same
    (``ValueError`` naming the clash: space the PUB and replay ports ``size`` apart)."""
    seen: dict[str, str] = {}
    for rank in range(size):
        ranked = config.for_rank(rank)
        for name, endpoint in (("endpoint", ranked.endpoint), ("replay", ranked.replay_endpoint)):
            if endpoint is None or endpoint.endswith((":*", ":0")):
                continue  # ephemeral: every socket gets its own port
            if endpoint in seen:
                raise ValueError(
                    f"kv_events_config: rank {rank}'s {name} {endpoint!r} is also "
                    f"{seen[endpoint]} (rank r publishes on the ports plus r: space the "
                    f"endpoint and replay_endpoint ports at least {size} apart)"
                )
            seen[endpoint] = f"rank {rank}'s {name}"


def rank_endpoint(endpoint: str, rank: int) -> str:
    """A data-parallel rank's endpoint: the port plus ``rank`` (``ValueError`` when that is
    not a port), ``_dp{rank}`` after an ipc/inproc name; rank 0 and ephemeral ports as given."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    base, colon, port = endpoint.rpartition(":")
    if not colon or port in ("*", "0"):
        return endpoint  # each rank's socket picks its own port (read it back from the socket)
    if not port.isdigit() or not 0 < int(port) + rank < 65536:
        raise ValueError(
            f"kv_events_config endpoint {endpoint!r}: rank {rank} publishes on the port plus "
            "its rank, which needs a port number"
        )
    return f"{base}:{int(port) + rank}"


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
