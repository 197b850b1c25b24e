"""The scheduler's LoRA rules (no torch): at most ``max_loras`` adapters among the running
requests, so every step fits the workers' device slots; and when an unloaded adapter's last
request has finished, so the workers may drop it."""

from __future__ import annotations

from collections.abc import Iterable

from tokenwire.runtime.core.request import Request


class LoRAAdmission:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._pending_removal: set[int] = set()

    @staticmethod
    def active(running: Iterable[Request]) -> set[int]:
        """Adapter ids of the running requests (0, the base model, excluded)."""
        return {r.lora_int_id for r in running if r.lora_request is not None}

    def allows(self, request: Request, active: set[int]) -> bool:
        """May ``request`` join a batch whose adapters are ``active``?"""
        lora_id = request.lora_int_id
        return lora_id == 0 or lora_id in active or len(active) < self.max_loras

    def remove(self, lora_id: int) -> None:
        """``lora_id`` was unloaded: drop it from the workers once no request uses it."""
        self._pending_removal.add(lora_id)

    def ready_removals(self, unfinished: Iterable[Request]) -> frozenset[int]:
        """Unloaded adapters no unfinished request uses any more (reported once)."""
        if not self._pending_removal:
            return frozenset()
        in_use = {r.lora_int_id for r in unfinished}
        ready = frozenset(self._pending_removal - in_use)
        self._pending_removal -= ready
        return ready
