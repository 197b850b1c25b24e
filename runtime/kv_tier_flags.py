"""Validation of the KV tiers' flags (docs/kv-tiers.md), kept beside ``config.py``."""

from __future__ import annotations


def check_tier_flags(host_gib: object, disk_path: str | None, disk_gib: object) -> None:
    """Sizes are GiB counts >= 0; the disk tier needs the host tier above it and a size."""
    for name, size in (("kv_offloading_size", host_gib), ("kv_offloading_disk_size", disk_gib)):
        if size is not None and (
            isinstance(size, bool)
            or not isinstance(size, int | float)
            or not 0 <= size < float("inf")
        ):
            raise ValueError(f"{name} must be a GiB count >= 0, got {size!r}")
    if disk_path and not (host_gib and disk_gib):
        raise ValueError(
            "--kv-offloading-disk-path needs --kv-offloading-size (the host tier above it) and "
            "--kv-offloading-disk-size (its GiB)"
        )
