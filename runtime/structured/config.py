"""Settings of structured outputs: the limits every constraint is checked against first, and
the engine core's compile pool and cache."""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20
# The engine flag that sets ``StructuredOutputsConfig.structured_outputs_cache_bytes`` (declared in
# ``runtime/engine_args.py``; a test checks the two agree). Named by the refusal of a grammar
# that alone compiles to more than the bound.
CACHE_BYTES_FLAG = "--structured-outputs-cache-bytes"


@dataclass(frozen=True)
class ConstraintLimits:
    """What a constraint may cost before any grammar work starts. ``max_chars``: length of
    its text (a schema's JSON, a regex, an EBNF grammar, choices as EBNF). ``max_depth``:
    nesting of a JSON schema document (``{"type": "string"}`` is 1; a 10-level object schema
    is about 20). ``check_timeout``: seconds the front's parse of a constraint may take (on
    a worker thread; a slower one is refused and remembered)."""

    max_chars: int = MIB
    max_depth: int = 64
    check_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.max_chars < 1 or self.max_depth < 1:
            raise ValueError("structured outputs max_chars and max_depth must be >= 1")
        if self.check_timeout <= 0:
            raise ValueError("structured outputs check_timeout must be > 0")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """``compile_timeout``: seconds a request waits for its grammar before it fails (the
    compile itself cannot be interrupted; its result still lands in the cache).
    ``max_workers``: compile threads (xgrammar compiles with the interpreter lock released).
    ``compiler_threads``: xgrammar's own threads per compile. ``cache_size``: compiled
    grammars kept (least recently used dropped first).
    ``structured_outputs_cache_bytes`` (its flag's name): their memory (xgrammar's
    ``CompiledGrammar.memory_size_bytes``) at most, and the most one grammar may compile to
    (a larger one fails its request with INVALID_ARGUMENT naming the flag, so no request holds
    more than the bound); 512 MiB as vLLM's ``VLLM_XGRAMMAR_CACHE_MB`` (a 40k-entry enum
    compiles to ~107-130 MB with a 49k vocabulary: four fit). ``limits``: checked again in the
    core before a compile."""

    compile_timeout: float = 30.0
    max_workers: int = 2
    compiler_threads: int = 1
    cache_size: int = 256
    structured_outputs_cache_bytes: int = 512 * MIB
    limits: ConstraintLimits = field(default_factory=ConstraintLimits)

    def __post_init__(self) -> None:
        if self.compile_timeout <= 0:
            raise ValueError("structured outputs compile_timeout must be > 0")
        if self.max_workers < 1 or self.compiler_threads < 1 or self.cache_size < 1:
            raise ValueError("structured outputs workers, threads and cache size must be >= 1")
        if self.structured_outputs_cache_bytes < 1:
            raise ValueError(
                "structured_outputs_cache_bytes must be >= 1, got "
                f"{self.structured_outputs_cache_bytes}"
            )
