"""``GrammarCompilerPool``: compiles constraints for one tokenizer off the engine's step loop.

Compiles run on a small thread pool (xgrammar compiles in C++ with the interpreter lock
released), so a slow schema never stalls a step; each starts with the size and depth limits
(a request that reached the core without the front's check fails on them, not in xgrammar).
Results are cached by ``GrammarSpec`` (kind, text, whitespace mode) — the pool belongs to one
tokenizer, so the tokenizer is part of every key — as futures: identical constraints arriving
together compile once. The cache holds at most ``cache_size`` grammars and
``structured_outputs_cache_bytes`` (``--structured-outputs-cache-bytes``) of compiled memory
(``CompiledGrammar.memory_size_bytes``), least recently used dropped first. A
grammar that alone compiles to more than that bound is refused (its future fails with a
message naming ``--structured-outputs-cache-bytes``: INVALID_ARGUMENT for its request) and
dropped at once; the failure stays cached, so the same schema is not compiled again. The
tokenizer's vocabulary (xgrammar ``TokenizerInfo``) is built on the pool by the first compile,
so an engine that never sees a constrained request never loads it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tokenwire.runtime.front.tokenizer import load_tokenizer
from tokenwire.runtime.structured.config import CACHE_BYTES_FLAG, MIB, StructuredOutputsConfig
from tokenwire.runtime.structured.limits import limits_problem
from tokenwire.runtime.structured.params import MAX_JSON_WHITESPACE, GrammarSpec
from tokenwire.runtime.structured.structural_tag import canonical


class GrammarCompilerPool:
    def __init__(
        self,
        tokenizer_path: str | None,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        config: StructuredOutputsConfig | None = None,
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.config = config or StructuredOutputsConfig()
        self._executor: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self._sizes: dict[GrammarSpec, int] = {}  # compiled bytes of the finished entries
        self._cache_bytes = 0
        self._cache_lock = threading.Lock()  # compiles finish on the pool's threads
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built by the first compile
        self._compiler_lock = threading.Lock()

    @property
    def cache_bytes(self) -> int:
        """Compiled memory the cache holds (finished compiles only)."""
        return self._cache_bytes

    @property
    def cache_len(self) -> int:
        return len(self._cache)

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        """A future of the ``xgrammar.CompiledGrammar`` for ``spec`` (cached). Called from
        the engine core's thread only."""
        with self._cache_lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.config.max_workers, thread_name_prefix="tokenwire-grammar"
                )
            future = self._executor.submit(self._compile, spec)
            self._cache[spec] = future
            self._trim()
        future.add_done_callback(lambda done: self._account(spec, done))
        return future

    def _account(self, spec: GrammarSpec, future: Future[Any]) -> None:
        """Count a finished compile's memory against the byte bound, then trim."""
        if future.cancelled() or future.exception() is not None:
            return  # a failure holds no compiled memory
        size = int(future.result().memory_size_bytes)
        with self._cache_lock:
            if self._cache.get(spec) is not future or spec in self._sizes:
                return  # dropped while compiling
            self._sizes[spec] = size
            self._cache_bytes += size
            self._trim()

    def _trim(self) -> None:
        """Drop least recently used entries past ``cache_size`` or the byte bound."""
        while len(self._cache) > self.config.cache_size or (
            self._cache_bytes > self.config.structured_outputs_cache_bytes and self._sizes
        ):
            if len(self._cache) > self.config.cache_size:
                spec = next(iter(self._cache))
            else:  # the least recently used entry that holds memory
                spec = next(s for s in self._cache if s in self._sizes)
            del self._cache[spec]
            self._cache_bytes -= self._sizes.pop(spec, 0)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ on the pool
    def _compile(self, spec: GrammarSpec) -> Any:
        problem = limits_problem(spec, self.config.limits)
        if problem is not None:
            raise ValueError(f"the constraint {problem}")
        compiled = self._compile_spec(spec)
        size = int(compiled.memory_size_bytes)
        bound = self.config.structured_outputs_cache_bytes
        if size > bound:
            del compiled  # the failure's traceback keeps this frame: free the grammar now
            raise ValueError(
                f"the constraint compiles to {size / MIB:.1f} MiB of grammar; the server "
                f"allows at most {bound / MIB:.1f} MiB ({CACHE_BYTES_FLAG} {bound}); "
                "simplify the constraint (fewer enum values or alternatives)"
            )
        return compiled

    def _compile_spec(self, spec: GrammarSpec) -> Any:
        compiler = self._get_compiler()
        if spec.kind == "json":
            return compiler.compile_json_schema(
                spec.text,
                any_whitespace=spec.any_whitespace,
                max_whitespace_cnt=MAX_JSON_WHITESPACE if spec.any_whitespace else None,
            )
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(canonical(spec.text))
        return compiler.compile_grammar(spec.text)

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._build_compiler()
            return self._compiler

    def _build_compiler(self) -> Any:
        import xgrammar as xgr

        if self.tokenizer_path is None:
            raise ValueError("this model has no tokenizer to constrain its output")
        tokenizer = load_tokenizer(self.tokenizer_path)
        if tokenizer is None:
            raise ValueError("this model has no tokenizer to constrain its output")
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids)
        )
        # The pool's cache replaces xgrammar's own (which would hold a second copy).
        return xgr.GrammarCompiler(
            info, max_threads=self.config.compiler_threads, cache_enabled=False
        )
