"""The Responses API's flags, declared once (``tokenwire serve`` and ``tokenwire rest``)."""

from __future__ import annotations

import argparse

from tokenwire.server.rest.responses_api.store import ResponsesSettings


def add_responses_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--responses-max-stored",
        type=int,
        default=ResponsesSettings.max_count,
        help="Responses API: stored responses kept per API key, the oldest dropped first "
        f"(0: store nothing; default {ResponsesSettings.max_count})",
    )
    p.add_argument(
        "--responses-max-stored-bytes",
        type=int,
        default=ResponsesSettings.max_bytes,
        help="Responses API: bytes of stored responses (JSON + conversation) per API key "
        f"(default {ResponsesSettings.max_bytes >> 20} MiB)",
    )
    p.add_argument(
        "--responses-max-age",
        type=float,
        default=ResponsesSettings.max_age,
        help="Responses API: seconds a stored response (and its KV blocks) is kept "
        f"(default {ResponsesSettings.max_age:g})",
    )


def responses_settings(args: argparse.Namespace) -> ResponsesSettings:
    """``ValueError`` naming the flag for a bad value."""
    return ResponsesSettings(
        max_count=args.responses_max_stored,
        max_bytes=args.responses_max_stored_bytes,
        max_age=args.responses_max_age,
    )
