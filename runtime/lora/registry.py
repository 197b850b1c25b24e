"""The engine core's adapters: name -> ``LoRARequest``, each checked before it is accepted.

The core is the one authority on adapter ids (``lora_int_id``, unique per load), so the
front, the scheduler's prefix-cache keys and the workers' caches all agree on them.
"""

from __future__ import annotations

from tokenwire.runtime.config import LoRAConfig
from tokenwire.runtime.errors import AdapterError, AdapterExistsError, AdapterNotFoundError
from tokenwire.runtime.lora.adapter import inspect_adapter
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.models.arch import ModelArch


class LoRARegistry:
    def __init__(self, config: LoRAConfig, arch: ModelArch) -> None:
        self.config = config
        self.arch = arch
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    @property
    def enabled(self) -> bool:
        return self.config.enable_lora

    def adapters(self) -> tuple[LoRARequest, ...]:
        return tuple(self._by_name.values())

    def load_startup_modules(self) -> None:
        """``--lora-modules``: a bad one is a startup error naming the flag."""
        for name, path in self.config.lora_modules:
            try:
                self.add(name, path)
            except (AdapterError, AdapterExistsError) as exc:
                raise ValueError(f"--lora-modules {name}=...: {exc}") from None

    def add(self, name: str, path: str) -> LoRARequest:
        if not self.enabled:
            raise AdapterError("lora", "LoRA is not enabled: start the engine with --enable-lora")
        if not name or name.strip() != name:
            raise AdapterError("lora_name", "must be a non-empty name without outer spaces")
        if name in self._by_name:
            raise AdapterExistsError(name)
        inspect_adapter(path, self.arch, self.config.max_lora_rank)
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self._by_name[name] = request
        return request

    def remove(self, name: str) -> LoRARequest:
        request = self._by_name.pop(name, None)
        if request is None:
            raise AdapterNotFoundError(name)
        return request

    def check(self, request: LoRARequest) -> None:
        """A request's adapter must be loaded (``AdapterNotFoundError`` otherwise)."""
        if self._by_name.get(request.lora_name) != request:
            raise AdapterNotFoundError(request.lora_name)
