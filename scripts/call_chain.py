"""The longest chain of repo files one gRPC ``Generate`` crosses (layout issue's "Show" figure).

Serves a tiny random llama in-process (``ServerHarness(in_process=True)``: servicer, front,
engine core and worker in one process, each on its own thread), sends one greedy Generate and
records, at every Python call on every thread, the stack's repo files in call order with
repeats collapsed (a -> b -> a counts three). Prints the longest such chain per thread role and
the number of distinct repo files the request touched. Runs against any commit that has the
test harness (``tests/server_harness.py`` before the tests moved, ``tests/support/`` after)::

    PYTHONSAFEPATH=1 .venv/bin/python scripts/call_chain.py
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class ChainTracer:
    """Keeps, per thread name, the longest file chain seen on a stack."""

    def __init__(self, roots: tuple[str, ...], skip: str) -> None:
        self.roots, self.skip = roots, skip
        self.longest: dict[str, list[str]] = {}
        self.files: set[str] = set()
        self.enabled = threading.Event()

    def _chain(self, frame: FrameType | None) -> list[str]:
        chain: list[str] = []
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(self.roots) and not name.startswith(self.skip):
                rel = name.split("/tokenwire/", 1)[-1] if "/tokenwire/" in name else name
                if not chain or chain[-1] != rel:
                    chain.append(rel)
            frame = frame.f_back
        return chain[::-1]

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.enabled.is_set():
            return
        chain = self._chain(frame)
        if not chain:
            return
        self.files.update(chain)
        role = threading.current_thread().name.split("-")[0]
        if len(chain) > len(self.longest.get(role, [])):
            self.longest[role] = chain


def main() -> None:
    for helpers in (REPO / "tests" / "support", REPO / "tests"):
        sys.path.insert(0, str(helpers))
    from grpc_helpers import greedy_request  # type: ignore[import-not-found]
    from server_harness import ServerHarness  # type: ignore[import-not-found]

    try:
        from tiny_models import build_tiny_model  # type: ignore[import-not-found]
    except ImportError:  # before the tests moved: the builder lived in conftest
        from conftest import build_tiny_model  # type: ignore[import-not-found,no-redef]

    import tokenwire
    from tokenwire.v1 import generation_pb2_grpc

    package = Path(next(iter(tokenwire.__path__)))
    tracer = ChainTracer((str(package),), str(REPO / "tests"))
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model("llama", Path(tmp))
        # Python 3.11 has no setprofile_all_threads: hook threads as they start, then record
        # only while the measured request runs.
        threading.setprofile(tracer.profile)
        sys.setprofile(tracer.profile)
        harness = ServerHarness(model, in_process=True).start()
        request = greedy_request([5, 6, 7, 8], 4)
        with harness.channel() as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            stub.Generate(request)  # warm: imports and first-call paths out of the figure
            tracer.enabled.set()
            stub.Generate(request)
            tracer.enabled.clear()
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        harness.stop()
    for role, chain in sorted(tracer.longest.items(), key=lambda kv: -len(kv[1])):
        print(f"{role}: {len(chain)} files: {' -> '.join(chain)}")
    print(f"distinct repo files touched by one Generate: {len(tracer.files)}")


if __name__ == "__main__":
    main()
