"""Child processes never outlive their parent: the parent keeps the only write end of a pipe,
the child watches the read end on a thread and exits the moment it reads EOF (the kernel
closes the parent's end however the parent dies, SIGKILL included)."""

from __future__ import annotations

import contextlib
import os
import threading
from multiprocessing.connection import Connection


def watch_parent(pipe: Connection, exit_code: int = 1) -> None:
    """Start the watcher thread in the child; ``pipe`` is the child's read end."""

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                pipe.recv()
        os._exit(exit_code)

    threading.Thread(target=watch, name="tokenwire-parent-watch", daemon=True).start()
