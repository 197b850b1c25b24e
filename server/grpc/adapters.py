"""LoRA adapters on the server side: which adapter a request's ``model`` selects, and the
runtime loading / unloading behind ``ModelService.LoadAdapter`` / ``UnloadAdapter``.

A request's ``model`` is the served model's name (or empty) for the base model, or the name
of a loaded adapter; anything else is NOT_FOUND (MODEL_NOT_FOUND). Runtime updates are off
unless the server runs with ``--allow-runtime-lora-updating``, which needs an API key (every
call then carries one) and ``--lora-root DIR``: a ``lora_path`` is resolved against the root
(``realpath``: neither ``..`` nor a symlink can leave it) and must lie inside it, and so
must the real path of each file the engine opens in it (``adapter_config.json``,
``adapter_model.safetensors``: a file symlinked out of the root is refused). Messages never
show the resolved path or the root: only what the client sent. Engine calls are shielded, so
a caller who gives up mid-load never leaves the engine half-way.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import grpc

from tokenwire.runtime.engine.protocol import EngineClient
from tokenwire.runtime.errors import AdapterError, AdapterNotFoundError, clip
from tokenwire.runtime.lora.request import ADAPTER_FILES, LoRARequest
from tokenwire.server.grpc.errors import ServiceError, invalid_parameter, model_not_found
from tokenwire.server.telemetry.logs import get_logger
from tokenwire.v1 import errors_pb2

MAX_ADAPTER_NAME_CHARS = 128
RUNTIME_FLAG = "--allow-runtime-lora-updating"
ROOT_PLACEHOLDER = "<lora-root>"
# Engine error params that are request fields; any other names a part of the adapter's files.
_REQUEST_FIELDS = frozenset({"lora_name", "lora_path", "lora"})
logger = get_logger("tokenwire.lora")


@dataclass(frozen=True)
class AdapterFlags:
    """Server flags: ``--allow-runtime-lora-updating`` and ``--lora-root``."""

    allow_runtime_lora_updating: bool = False
    lora_root: str | None = None

    def check(self, api_keys: tuple[str, ...]) -> None:
        """Startup errors naming the flag to change."""
        if self.lora_root is not None and not os.path.isdir(self.lora_root):
            raise ValueError(f"--lora-root {self.lora_root!r} is not a directory")
        if not self.allow_runtime_lora_updating:
            return
        if not api_keys:
            raise ValueError(
                f"{RUNTIME_FLAG} needs --api-key (or TOKENWIRE_API_KEY): loading adapters at "
                "runtime is only allowed to authenticated callers"
            )
        if self.lora_root is None:
            raise ValueError(
                f"{RUNTIME_FLAG} needs --lora-root DIR: adapter paths must lie inside it"
            )


def resolve_model(engine: EngineClient, base_name: str, name: str) -> LoRARequest | None:
    """The adapter a request's ``model`` selects (None: the base model); NOT_FOUND else."""
    if not name or name == base_name:
        return None
    lora = engine.get_lora(name) if engine.info.max_loras > 0 else None
    if lora is None:
        raise model_not_found(name)
    return lora


def adapter_not_found(name: str) -> ServiceError:
    """LoadAdapter / UnloadAdapter of a name that is not loaded, or that the caller's tenant
    may not use: the same answer, so it tells nothing about other tenants' adapters."""
    err = model_not_found(name)
    return ServiceError(err.code, err.reason, err.message, {**err.metadata, "param": "lora_name"})


def updating_disabled() -> ServiceError:
    return ServiceError(
        grpc.StatusCode.PERMISSION_DENIED,
        errors_pb2.ERROR_REASON_LORA_UPDATING_DISABLED,
        f"loading and unloading LoRA adapters at runtime is off on this server: start it "
        f"with {RUNTIME_FLAG} (and --api-key, --lora-root DIR)",
    )


def check_adapter_name(name: str, base_name: str) -> None:
    if not name:
        raise invalid_parameter("lora_name", "is required")
    if (
        len(name) > MAX_ADAPTER_NAME_CHARS
        or not name.isprintable()
        or any(c.isspace() or c == "," for c in name)
    ):
        raise invalid_parameter(
            "lora_name",
            f"must be 1 to {MAX_ADAPTER_NAME_CHARS} printable characters without spaces or commas",
        )
    if name == base_name:
        raise invalid_parameter("lora_name", f"{clip(name)!r} is the base model's name")


class AdapterAdmin:
    """LoadAdapter / UnloadAdapter: the flag, the name and path rules, then the engine."""

    def __init__(self, engine: EngineClient, base_name: str, flags: AdapterFlags) -> None:
        self.engine = engine
        self.base_name = base_name
        self.allowed = flags.allow_runtime_lora_updating
        self.root = os.path.realpath(flags.lora_root) if flags.lora_root is not None else None

    def resolve_path(self, given: str) -> str:
        """``given`` (relative to the root, or absolute) -> the real directory inside the root."""
        if not given:
            raise invalid_parameter("lora_path", "is required")
        if self.root is None:  # the flags checks rule this out on a served server
            raise updating_disabled()
        if "\x00" in given:
            raise invalid_parameter("lora_path", "must not contain NUL characters")
        resolved = os.path.realpath(os.path.join(self.root, given))
        if not self._inside(resolved):
            raise invalid_parameter(
                "lora_path", "must name a directory inside the server's --lora-root"
            )
        if not os.path.isdir(resolved):
            raise invalid_parameter("lora_path", "no adapter directory there")
        # Every file the engine opens, not only the folder: a file may be a symlink too.
        for name in ADAPTER_FILES:
            if not self._inside(os.path.realpath(os.path.join(resolved, name))):
                raise invalid_parameter(
                    "lora_path", f"its {name} must lie inside the server's --lora-root"
                )
        return resolved

    def _inside(self, real: str) -> bool:
        assert self.root is not None
        return os.path.commonpath([self.root, real]) == self.root

    async def load(self, name: str, given_path: str) -> LoRARequest:
        if not self.allowed:
            raise updating_disabled()
        check_adapter_name(name, self.base_name)
        path = self.resolve_path(given_path)
        try:
            lora = await asyncio.shield(self.engine.add_lora(name, path))
        except AdapterError as exc:
            raise self._scrubbed(exc, path, given_path) from None
        logger.info("lora_adapter_loaded", lora_name=name, lora_int_id=lora.lora_int_id)
        return lora

    async def unload(self, name: str) -> None:
        if not self.allowed:
            raise updating_disabled()
        if not name:
            raise invalid_parameter("lora_name", "is required")
        try:
            await asyncio.shield(self.engine.remove_lora(name))
        except AdapterNotFoundError:
            raise adapter_not_found(name) from None
        logger.info("lora_adapter_unloaded", lora_name=name)

    def _scrubbed(self, exc: AdapterError, path: str, given: str) -> AdapterError:
        """The engine's error in the client's terms: a problem inside the adapter's files
        (``adapter_config.json:r``, ``adapter_model.safetensors``) names the request field
        ``lora_path`` and keeps the file's part in the message; the resolved path (and the
        root) read as what the client sent."""
        message = str(exc).replace(path, clip(given))
        if self.root is not None:
            message = message.replace(self.root, ROOT_PLACEHOLDER)
        if exc.param in _REQUEST_FIELDS:
            return AdapterError(exc.param, message.removeprefix(f"{exc.param}: "))
        return AdapterError("lora_path", message)
