"""``LoRARequest``: which adapter a request runs with (vLLM's record of the same name).

Plain data: it travels from the front through the engine core to every worker inside
``NewRequestData``, and the worker loads the adapter from ``lora_path`` the first time it
sees ``lora_int_id``. ``lora_int_id`` is unique per load within one engine: unloading an
adapter and loading another under the same name gives a new id, so neither the workers'
caches nor the prefix cache can confuse the two.
"""

from __future__ import annotations

from dataclasses import dataclass

# The two files of a PEFT adapter directory (every one the engine opens).
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str  # what clients put in ``model``
    lora_int_id: int  # > 0, unique per load within one engine
    lora_path: str  # directory holding adapter_config.json + adapter_model.safetensors

    def __post_init__(self) -> None:
        if self.lora_int_id <= 0:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")

    @property
    def cache_key(self) -> bytes:
        """Extra key of a request's first KV block hash: adapters never share KV blocks."""
        return f"lora:{self.lora_int_id}:{self.lora_name}".encode()
