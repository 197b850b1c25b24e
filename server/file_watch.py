"""Reload when a watched file changes: what SIGHUP does, without the signal.

Kubernetes updates a mounted Secret in place (it swaps the volume's ``..data`` link to a new
folder) and sends the process nothing, so ``--reload-interval SECONDS`` polls the TLS files
and the tenant key file and runs the same reload hooks as SIGHUP when any of them changes.
A file's identity is ``(inode, mtime, size)`` of what its path resolves to, so both an
in-place write and a link swap count; a missing file is a state of its own (its return is a
change). A reload that fails (a file half-written) keeps the old state and logs why, as on
SIGHUP; the next change reloads again.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence

from tokenwire.server.telemetry.logs import get_logger

logger = get_logger("tokenwire.serve")

Signature = tuple[int, int, int] | None


def signature(path: str) -> Signature:
    """``(inode, mtime ns, size)`` of the file ``path`` resolves to; None when it is absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class FileWatcher:
    """Calls ``on_change`` once per look that finds any of ``paths`` changed since the
    previous look (the first look compares with the files at construction)."""

    def __init__(self, paths: Sequence[str], on_change: Callable[[], None]) -> None:
        self.paths = list(paths)
        self.on_change = on_change
        self._last = [signature(p) for p in self.paths]

    def check(self) -> bool:
        """One look; True if something changed (and ``on_change`` ran)."""
        now = [signature(p) for p in self.paths]
        if now == self._last:
            return False
        changed = [p for p, a, b in zip(self.paths, self._last, now, strict=True) if a != b]
        logger.info("watched files changed: reloading", files=changed)
        self._last = now
        try:
            self.on_change()
        except Exception:  # a reload that raises must not end the watching
            logger.exception("reload after a file change failed")
        return True

    async def run(self, interval: float) -> None:
        """Look every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)  # the polling period itself, not a synchronisation
            self.check()


def watched_paths(*groups: Sequence[str | None]) -> list[str]:
    """The distinct file paths of ``groups`` (None entries dropped), in order."""
    out: list[str] = []
    for group in groups:
        for path in group:
            if path is not None and path not in out:
                out.append(path)
    return out
