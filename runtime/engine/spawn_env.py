"""The environment a spawned engine core starts with: OpenMP threads that spin briefly, then sleep.

The front (gRPC, detokenization, streaming) and the engine core are two processes on the same
cores. libgomp, torch's OpenMP runtime on Linux, keeps each of the core's worker threads
spinning for about 300,000 iterations after every parallel region when ``OMP_WAIT_POLICY`` is
unset, so between the many small parallel ops of a CPU decode step the core's threads hold
every core while the front waits for one. On the 2-core box, served with 32 requests in
flight, that starved the front: the ``cpu`` workload timed out (no figure in 240 s) with the
default. Sleeping at once (``OMP_WAIT_POLICY=PASSIVE``) removed the collapse but woke every
thread through a futex for each parallel region; a short spin (``GOMP_SPINCOUNT=10000``, a few
microseconds) covers the gaps between the ops of one step and sleeps between steps: measured
+81% one-stream and +30% at 16 in flight over passive (docs/benchmarks.md, "CPU serving: the
core's OpenMP threads spin briefly"). libgomp reads these variables once, when it is loaded,
so they must be in the environment the core process is spawned with.

A user who sets ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` keeps their choice. The offline
``LLM`` (no front beside it) is left alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
CORE_ENV = {"GOMP_SPINCOUNT": "10000"}


def core_env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """What the spawned core's environment adds to ``environ`` (nothing the user set)."""
    if any(knob in environ for knob in USER_KNOBS):
        return {}
    return dict(CORE_ENV)


@contextmanager
def spawn_environment(overrides: Mapping[str, str]) -> Iterator[None]:
    """``overrides`` in this process's environment while a child is spawned (a spawned
    child inherits it), restored afterwards."""
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
