"""Per-request output stream between the engine front and one asyncio consumer.

All methods run on the event loop thread (the front hands each step over in one
batch), so no locks are needed. The engine never waits on a consumer:
when a client reads slowly, pending deltas of the same choice are merged in place, so a
stream holds at most one pending delta per choice plus its start / end / final items.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tokenwire.runtime.outputs import ChoiceDelta, RequestOutput, RequestStarted


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """Last item of a stream: the complete output (text, tokens, usage)."""

    output: RequestOutput


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """The engine failed while serving this request; no more items follow."""

    error: BaseException


StreamItem = RequestStarted | ChoiceDelta | RequestFinished | RequestFailed


class RequestStream:
    def __init__(self, request_id: str, num_seqs: int = 1) -> None:
        self.request_id = request_id
        self.num_seqs = num_seqs  # choices: what the stream holds of the admission limit
        self.abort_requested = False  # Cancel answers ``true`` once per request
        self._items: deque[StreamItem] = deque()
        # Choice index -> its delta still waiting in ``_items`` (merge target).
        self._pending: dict[int, ChoiceDelta] = {}
        self._ready = asyncio.Event()
        self.done = False  # a RequestFinished / RequestFailed was queued

    def put(self, item: StreamItem) -> None:
        if self.done:
            return
        if isinstance(item, ChoiceDelta):
            pending = self._pending.get(item.index)
            if pending is not None:
                _merge(pending, item)
                if pending.finish_reason is not None:
                    del self._pending[item.index]
                return
            if item.finish_reason is None:
                self._pending[item.index] = item
        elif isinstance(item, (RequestFinished, RequestFailed)):
            self.done = True
        self._items.append(item)
        self._ready.set()

    async def get(self) -> StreamItem:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, ChoiceDelta) and self._pending.get(item.index) is item:
            del self._pending[item.index]
        return item

    def __aiter__(self) -> AsyncIterator[StreamItem]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamItem]:
        while True:
            item = await self.get()
            yield item
            if isinstance(item, (RequestFinished, RequestFailed)):
                return

    @property
    def num_queued(self) -> int:
        return len(self._items)


def _merge(into: ChoiceDelta, new: ChoiceDelta) -> None:
    """Append ``new`` to an unconsumed delta of the same choice."""
    into.text += new.text
    into.token_ids.extend(new.token_ids)
    if new.logprobs is not None:
        into.logprobs = (into.logprobs or []) + new.logprobs
    into.finish_reason = new.finish_reason
    into.stop_reason = new.stop_reason
