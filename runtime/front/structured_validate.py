"""Front-side check that a request's constraint compiles, with the compiler's own message.

xgrammar parses a JSON schema, regex or EBNF grammar into a tokenizer-independent ``Grammar``;
only that parse runs here (in the front, before anything reaches the engine core), so a bad
schema fails its call at once as a ``ParameterError`` naming the field. The tokenizer-dependent
compile happens later, in the core's compile pool.

A parse usually takes a millisecond, but a crafted schema can take seconds, so no parse ever
runs on the caller's thread: first the cheap checks (a tokenizer, the length limit, a verdict
remembered for the same constraint), then the depth limit and the parse on the validator's
worker threads (xgrammar parses with the interpreter lock released) under ``check_timeout``.
A parse slower than that is refused and remembered as too slow. Verdicts are remembered by
a 16-byte digest of the constraint (never its text): at most ``capacity`` of them, each with a
message of at most ``MAX_MESSAGE_CHARS``.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from tokenwire.runtime.errors import ParameterError, clip
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.structured.config import ConstraintLimits
from tokenwire.runtime.structured.limits import depth_problem, length_problem
from tokenwire.runtime.structured.params import FIELD, MAX_JSON_WHITESPACE, GrammarSpec
from tokenwire.runtime.structured.structural_tag import canonical

# xgrammar prefixes its messages with a time stamp, a source path and the failed check.
_PREFIX = re.compile(
    r"^\s*(\[[0-9:]+\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?(Check failed:.*?is false:\s*)?"
)
MAX_MESSAGE_CHARS = 512


def compiler_message(exc: BaseException) -> str:
    """The compiler's message without time stamp, source path or check text, clipped."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return clip(_PREFIX.sub("", text).strip(), MAX_MESSAGE_CHARS)


def parse_grammar(spec: GrammarSpec) -> None:
    """Raise xgrammar's error when ``spec`` does not parse (no tokenizer needed)."""
    import xgrammar as xgr

    if spec.kind == "json":
        xgr.Grammar.from_json_schema(
            spec.text,
            any_whitespace=spec.any_whitespace,
            max_whitespace_cnt=MAX_JSON_WHITESPACE if spec.any_whitespace else None,
        )
    elif spec.kind == "regex":
        xgr.Grammar.from_regex(spec.text)
    elif spec.kind == "structural_tag":
        xgr.Grammar.from_structural_tag(canonical(spec.text))
    else:
        xgr.Grammar.from_ebnf(spec.text)


def too_slow(timeout: float) -> str:
    return (
        f"checking the constraint took longer than {timeout:g} s (the server's limit); simplify it"
    )


@dataclass(frozen=True, slots=True)
class PendingCheck:
    """A constraint that passed the cheap checks and still has to be parsed."""

    spec: GrammarSpec
    key: bytes  # digest of the spec: what verdicts are remembered by
    param: str  # the field errors name, e.g. ``structured_outputs.json``


class StructuredValidator:
    """Checks ``SamplingParams.structured_outputs``. ``has_tokenizer``: structured outputs
    need the model's tokenizer. ``limits`` may be replaced while serving (tests do)."""

    def __init__(
        self,
        has_tokenizer: bool,
        limits: ConstraintLimits | None = None,
        capacity: int = 1024,
        workers: int = 2,
    ) -> None:
        self.has_tokenizer = has_tokenizer
        self.limits = limits or ConstraintLimits()
        self.capacity = capacity
        self.workers = workers
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()  # None: it parses
        self._lock = threading.Lock()  # workers record verdicts
        self._executor: ThreadPoolExecutor | None = None

    @property
    def num_verdicts(self) -> int:
        return len(self._verdicts)

    def check_known(self, params: SamplingParams) -> PendingCheck | None:
        """The checks without grammar work (safe on an event loop): raises
        ``ParameterError``; returns what still needs parsing (None: nothing does)."""
        constraint = params.structured_outputs
        if constraint is None:
            return None
        if not self.has_tokenizer:
            raise ParameterError(FIELD, "this model has no tokenizer to constrain its output")
        spec = constraint.spec()
        param = f"{FIELD}.{constraint.kind}"
        problem = length_problem(spec, self.limits)
        if problem is not None:
            raise ParameterError(param, problem)
        key = _digest(spec)
        with self._lock:
            if key not in self._verdicts:
                return PendingCheck(spec, key, param)
            self._verdicts.move_to_end(key)
            verdict = self._verdicts[key]
        if verdict is not None:
            raise ParameterError(param, verdict)
        return None

    async def check_async(self, params: SamplingParams) -> None:
        """Every check; the grammar work on the worker threads. Raises ``ParameterError``."""
        pending = self.check_known(params)
        if pending is None:
            return
        timeout = self.limits.check_timeout
        future = self._submit(pending)
        try:
            verdict = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except TimeoutError:  # the parse goes on; its worker remembers the verdict
            verdict = too_slow(timeout)
        if verdict is not None:
            raise ParameterError(pending.param, verdict)

    def check(self, params: SamplingParams) -> None:
        """``check_async`` for a blocking caller (the offline ``LLM``)."""
        pending = self.check_known(params)
        if pending is None:
            return
        timeout = self.limits.check_timeout
        future = self._submit(pending)
        try:
            verdict = future.result(timeout)
        except TimeoutError:
            future.cancel()
            verdict = too_slow(timeout)
        if verdict is not None:
            raise ParameterError(pending.param, verdict)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ on the workers
    def _submit(self, pending: PendingCheck) -> Future[str | None]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self.workers, thread_name_prefix="tokenwire-grammar-check"
            )
        return self._executor.submit(self._verdict, pending)

    def _verdict(self, pending: PendingCheck) -> str | None:
        """None when the constraint parses within the limits, else why not (remembered)."""
        with self._lock:
            if pending.key in self._verdicts:  # a twin queued ahead of this check decided
                return self._verdicts[pending.key]
        limits = self.limits
        start = time.monotonic()
        verdict = depth_problem(pending.spec, limits)
        if verdict is None:
            try:
                parse_grammar(pending.spec)
            except Exception as exc:  # xgrammar raises RuntimeError (and ValueError)
                verdict = compiler_message(exc)
        if verdict is None and time.monotonic() - start > limits.check_timeout:
            verdict = too_slow(limits.check_timeout)
        with self._lock:
            self._verdicts[pending.key] = verdict
            while len(self._verdicts) > self.capacity:
                self._verdicts.popitem(last=False)
        return verdict


def _digest(spec: GrammarSpec) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{spec.kind}\0{int(spec.any_whitespace)}\0".encode())
    h.update(spec.text.encode("utf-8", "surrogatepass"))
    return h.digest()
