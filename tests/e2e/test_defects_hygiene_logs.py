"""Console logs carry terminal colour codes only on a terminal (defects issue, item 19):
``--log-format console`` into a file or pipe is plain text, on a TTY it is coloured, and no
format passes on uvicorn's ``color_message`` (its message again, with escape codes). Each
case configures logging in a process of its own (the configuration is process-wide)."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

import pytest

ESC = "\x1b["
_LOG = """
import logging, sys
from tokenwire.server.telemetry.logs import configure_logging, get_logger
configure_logging(sys.argv[1])
get_logger("tokenwire.serve").warning("no --api-key configured", port=1)
logging.getLogger("uvicorn.error").info(
    "Started server process [%d]", 7, extra={"color_message": "Started [\\x1b[36m%d\\x1b[0m]"}
)
"""
ENV = dict(os.environ, PYTHONSAFEPATH="1")


@pytest.mark.parametrize("fmt", ["console", "json", "auto"])
def test_no_escape_codes_off_a_terminal(fmt: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LOG, fmt], capture_output=True, text=True, env=ENV, check=True
    )
    out = done.stdout
    assert "no --api-key configured" in out and "Started server process [7]" in out
    assert ESC not in out and "\\u001b" not in out, out
    assert "color_message" not in out


def test_console_on_a_terminal_is_coloured() -> None:
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOG, "auto"], stdout=child, stderr=subprocess.PIPE, env=ENV
    )
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the terminal's other side closed: the process is done
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert proc.wait(timeout=60) == 0
    out = b"".join(chunks).decode()
    assert "no --api-key configured" in out
    assert ESC in out  # a terminal: console format, with colours
    assert "color_message" not in out
