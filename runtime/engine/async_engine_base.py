"""The async engine's state and what it reports (``AsyncEngineBase``): the core client, the
open request streams and their sequence count, idle tracking, pending calls to the core, the
``Frontend`` once started, and the read-only facts the server uses (``info``, the stats
snapshot, the KV event stream). ``async_engine_outputs`` adds the routing of the core's outputs
on top and ``async_engine`` the lifecycle and request intake (``AsyncEngine``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from tokenwire.runtime.config import DEFAULT_MAX_REQUESTS, EngineConfig
from tokenwire.runtime.engine.client_factory import make_core_client
from tokenwire.runtime.engine.core_client import CoreClient
from tokenwire.runtime.engine.protocol import EngineInfo, EngineStatsSnapshot, IdleReport
from tokenwire.runtime.front.frontend import Frontend
from tokenwire.runtime.front.kv_event_hub import KVEventStream
from tokenwire.runtime.front.kv_events_front import KVEventsFront
from tokenwire.runtime.front.lora_front import LoRAFront
from tokenwire.runtime.front.request_stream import RequestStream
from tokenwire.runtime.front.tokenizer import Tokenizer
from tokenwire.runtime.stats import EngineObserver


class AsyncEngineBase:
    """The engine's state; ``AsyncEngine`` is what callers construct."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        observer: EngineObserver | None = None,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        in_process: bool = False,
        core_observer: EngineObserver | None = None,
    ) -> None:
        self.config = config
        self.observer = observer  # front side: sees every step's and request's statistics
        self.max_requests = max_requests  # sequences in flight (a request counts n)
        self.client: CoreClient = make_core_client(config, in_process, core_observer)
        self.ready = False  # set after warm-up; until then requests get NOT_READY
        self.draining = False
        self._info: EngineInfo | None = None
        self._frontend: Frontend | None = None
        self._streams: dict[str, RequestStream] = {}
        self._num_seqs = 0
        self._eviction_listeners: dict[str, Callable[[], None]] = {}
        self._on_dead: list[Callable[[], None]] = []
        self._dead: str | None = None
        self._closing = False
        self._loras = LoRAFront(self.client.send)
        self._idle = asyncio.Event()  # set while no stream is open
        self._idle.set()
        self._snapshot = EngineStatsSnapshot()
        self._idle_calls: dict[int, asyncio.Future[IdleReport]] = {}
        self._call_ids = itertools.count()
        self._output_task: asyncio.Task[None] | None = None
        self._kv_events = KVEventsFront.make(config)  # None unless --kv-events-config
        self._reset_calls: dict[int, asyncio.Future[bool]] = {}

    # ------------------------------------------------------------------ facts
    @property
    def info(self) -> EngineInfo:
        assert self._info is not None, "start() first"
        return self._info

    @property
    def frontend(self) -> Frontend:
        assert self._frontend is not None, "start() first"
        return self._frontend

    @property
    def tokenizer(self) -> Tokenizer | None:
        return None if self._frontend is None else self._frontend.tokenizer

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_seqs_in_flight(self) -> int:
        """Sequences of the open streams (a request with ``n`` choices counts ``n``)."""
        return self._num_seqs

    def stats_snapshot(self) -> EngineStatsSnapshot:
        return self._snapshot

    @property
    def kv_events(self) -> KVEventStream | None:
        """The KV-cache event stream (None unless ``--kv-events-config`` enables it): the one
        core's hub, or with several cores every rank's batches merged
        (``front.kv_event_merge``)."""
        return None if self._kv_events is None else self._kv_events.stream
