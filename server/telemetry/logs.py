"""structlog setup: JSON lines to stdout (console renderer on a TTY or ``--log-format console``).

Every record — tokenwire's structlog loggers and third-party stdlib loggers (grpc, uvicorn,
transformers) alike — goes through one ``ProcessorFormatter`` on the root handler, so the
output is one format. Fields: ISO UTC ``timestamp``, ``level``, ``logger``, ``event``, plus
whatever is bound through ``structlog.contextvars`` (``request_id``, ``trace_id``,
``span_id``) or passed with the call. Logging configuration is process-wide by nature
(like ``logging.basicConfig``); it is done once, by the command that owns the process.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import MutableMapping
from typing import Any, Literal

import structlog

LogFormat = Literal["auto", "json", "console"]
LOG_FORMATS: tuple[LogFormat, ...] = ("auto", "json", "console")

# Third-party loggers that are chatty at INFO; tokenwire's own logs stay at INFO.
_QUIET = {"uvicorn.access": logging.WARNING, "httpx": logging.WARNING}


def _shared_processors() -> list[Any]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


def _renderer(fmt: LogFormat) -> Any:
    tty = sys.stdout.isatty()
    if fmt == "console" or (fmt == "auto" and tty):
        return structlog.dev.ConsoleRenderer(colors=tty)  # no escape codes in a file or pipe
    return structlog.processors.JSONRenderer()


def _drop_color_message(
    logger: Any, name: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """uvicorn passes a copy of its message with terminal colour codes as ``extra``."""
    event.pop("color_message", None)
    return event


def configure_logging(fmt: LogFormat = "auto", level: int = logging.INFO) -> None:
    """Route structlog and stdlib logging through one formatter writing to stdout."""
    shared = _shared_processors()
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder(), _drop_color_message],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            _renderer(fmt),
        ],
    )
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name, quiet_level in _QUIET.items():
        logging.getLogger(name).setLevel(quiet_level)
    for name in ("uvicorn", "uvicorn.error", "grpc", "transformers"):
        third_party = logging.getLogger(name)
        third_party.handlers.clear()  # no private handlers: everything reaches the root's
        third_party.propagate = True


def get_logger(name: str) -> Any:
    """A structlog logger named ``name`` (the ``logger`` field)."""
    return structlog.stdlib.get_logger(name)


def add_log_format_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="auto",
        help="json lines (default off a TTY) or console (default on a TTY)",
    )
