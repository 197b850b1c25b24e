"""The checks the frozen configs' ``__post_init__`` share: each raises ``ValueError`` naming
the offending flag."""

from __future__ import annotations


def positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")


def whole_count(name: str, value: object) -> None:
    """A positive ``int`` (not a bool, a float or a numeric string)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
