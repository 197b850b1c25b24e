"""How an engine flag is declared (``FlagSpec``): ``arg(...)`` makes an ``EngineArgs`` field
that names the config dataclass and field it sets, with its help, type, choices and action;
its default is read from that config field (``config_default``), never written twice. Used by
``engine_args`` and the flag groups it builds on (``engine_args_model``, ``engine_args_batch``).
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FlagSpec:
    """How one ``EngineArgs`` field appears on the command line and in the config. The
    field, its config field and its flag (the name with dashes) have one name."""

    config: type  # the config dataclass holding this setting (and its default)
    config_field: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    action: str | builtins.type[argparse.Action] | None = None
    metavar: str | None = None


def config_default(config: type, name: str) -> Any:
    for f in dataclasses.fields(config):
        if f.name == name:
            if f.default is dataclasses.MISSING:
                raise TypeError(f"{config.__name__}.{name} has no plain default")
            return f.default
    raise TypeError(f"{config.__name__} has no field {name!r}")


def arg(
    config: type,
    config_field: str,
    help: str,
    *,
    type: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    action: str | type[argparse.Action] | None = None,
    metavar: str | None = None,
) -> Any:
    """An ``EngineArgs`` field declared as ``config``'s ``config_field`` (its default)."""
    spec = FlagSpec(config, config_field, help, type, choices, action, metavar)
    return dataclasses.field(default=config_default(config, config_field), metadata={"flag": spec})
