"""The front's view of the LoRA adapters: name -> ``LoRARequest``, kept in step with the core.

Loads and unloads are calls to the core (``AddLoRA`` / ``RemoveLoRA``), answered in order
with the core's other outputs. Before a load is sent, the front reads the adapter's files
itself (bounded, on a worker thread: ``lora.checks.read_adapter``), so a hostile or broken
adapter fails its call here and never reaches the core; the core checks it again against
the model. An unload takes the name out of this registry at once, so no
new request can select the adapter; requests already sent run to completion in the core.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from tokenwire.runtime.engine.messages import AddLoRA, CoreInput, LoRAReply, RemoveLoRA
from tokenwire.runtime.errors import AdapterError, AdapterExistsError, AdapterNotFoundError
from tokenwire.runtime.lora.checks import read_adapter
from tokenwire.runtime.lora.request import LoRARequest

LORA_CALL_TIMEOUT_S = 120.0  # reading a large adapter's header is quick; this is a backstop


class LoRAFront:
    def __init__(self, send: Callable[[CoreInput], None]) -> None:
        self._send = send
        self._by_name: dict[str, LoRARequest] = {}
        self._calls: dict[int, asyncio.Future[LoRAReply]] = {}
        self._call_ids = itertools.count(1)
        self._max_rank = 0  # 0: LoRA is off (the core says so)

    def seed(self, adapters: tuple[LoRARequest, ...], max_rank: int) -> None:
        """The adapters the core loaded at startup, and ``--max-lora-rank``."""
        self._by_name = {a.lora_name: a for a in adapters}
        self._max_rank = max_rank

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def list(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    async def add(self, name: str, path: str) -> LoRARequest:
        if name in self._by_name:
            raise AdapterExistsError(name)
        if self._max_rank > 0:
            await asyncio.to_thread(read_adapter, path, self._max_rank)
        reply = await self._call(lambda call_id: AddLoRA(call_id, name, path))
        if reply.lora is None:
            raise _error(reply, name)
        self._by_name[name] = reply.lora
        return reply.lora

    async def remove(self, name: str) -> None:
        if self._by_name.pop(name, None) is None:
            raise AdapterNotFoundError(name)
        reply = await self._call(lambda call_id: RemoveLoRA(call_id, name))
        if reply.lora is None:
            raise _error(reply, name)

    def on_reply(self, reply: LoRAReply) -> None:
        future = self._calls.pop(reply.call_id, None)
        if future is not None and not future.done():
            future.set_result(reply)

    def fail_all(self, exc: BaseException) -> None:
        """The core died: every pending call fails with ``exc``."""
        for future in self._calls.values():
            if not future.done():
                future.set_exception(exc)
        self._calls.clear()

    async def _call(self, make: Callable[[int], AddLoRA | RemoveLoRA]) -> LoRAReply:
        call_id = next(self._call_ids)
        future: asyncio.Future[LoRAReply] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(make(call_id))
        try:
            return await asyncio.wait_for(future, LORA_CALL_TIMEOUT_S)
        finally:
            self._calls.pop(call_id, None)


def _error(reply: LoRAReply, name: str) -> Exception:
    if reply.error == "exists":
        return AdapterExistsError(name)
    if reply.error == "not_found":
        return AdapterNotFoundError(name)
    message = reply.message.removeprefix(f"{reply.param}: ")
    return AdapterError(reply.param or "lora", message)
