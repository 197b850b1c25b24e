"""Settings of the engine core's structured-output machinery (compile pool and cache)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """``compile_timeout``: seconds a request waits for its grammar before it fails (the
    compile itself cannot be interrupted; its result still lands in the cache).
    ``max_workers``: compile threads (xgrammar compiles with the interpreter lock released).
    ``compiler_threads``: xgrammar's own threads per compile. ``cache_size``: compiled
    grammars kept (least recently used dropped first)."""

    compile_timeout: float = 30.0
    max_workers: int = 2
    compiler_threads: int = 1
    cache_size: int = 256

    def __post_init__(self) -> None:
        if self.compile_timeout <= 0:
            raise ValueError("structured outputs compile_timeout must be > 0")
        if self.max_workers < 1 or self.compiler_threads < 1 or self.cache_size < 1:
            raise ValueError("structured outputs workers, threads and cache size must be >= 1")
