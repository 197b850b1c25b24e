"""tokenwire command line."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    raise SystemExit("not implemented yet")
