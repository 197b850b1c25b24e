"""Incremental detokenization with stop strings (runs in the front end, never in the engine core).

``IncrementalDetokenizer`` turns the token ids the engine produces for one choice into text
deltas that are safe to stream:

* Incomplete UTF-8 is held back. A byte-level BPE token may carry only part of a multi-byte
  character; its text then decodes to U+FFFD until a later token completes it.
* Text that may be the beginning of a stop string is held back, so a stop string that is
  excluded from the output is never streamed and then taken back.

Decoding uses the prefix/read-offset algorithm (as vLLM's slow path and the ``tokenizers``
``DecodeStream`` do) over the Rust ``tokenizers.Tokenizer`` behind a transformers tokenizer. We
keep the state ourselves rather than using ``DecodeStream`` because ``flush`` must release the
text of tokens still pending when generation ends mid-character, and ``DecodeStream`` offers no
way to read or flush its pending tokens.

Invariant: the concatenation of every delta returned by ``update`` and ``flush`` equals
``output_text``; when no stop string matched, after ``flush`` it also equals
``tokenizer.decode(output_ids, skip_special_tokens=...)`` (for decoders that are stable under
appending, which byte-level BPE and sentencepiece-style Metaspace decoders are). Deviation:
transformers' ``clean_up_tokenization_spaces`` post-processing is not applied (as in vLLM);
transformers 5 skips it for BPE tokenizers anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenizers import Tokenizer as RustTokenizer

from tokenwire.runtime.front.tokenizer import Tokenizer
from tokenwire.runtime.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first output token, so that the output's first
# token decodes as it reads after the prompt (sentencepiece decoders strip the leading space of
# the first token of a decode; in context it is kept, as in vLLM).
PROMPT_CONTEXT_TOKENS = 6

DecodeFn = Callable[[list[int]], str]


def make_decode_fn(tokenizer: Tokenizer | RustTokenizer, skip_special_tokens: bool) -> DecodeFn:
    """``ids -> text`` through the tokenizer's Rust backend when it has one.

    ``tokenizer`` is a transformers tokenizer or a ``tokenizers.Tokenizer``; going straight to
    the backend skips several microseconds of Python wrapper per call (one or two calls per
    generated token).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    target = backend if isinstance(backend, RustTokenizer) else tokenizer

    def decode(ids: list[int]) -> str:
        return str(target.decode(ids, skip_special_tokens=skip_special_tokens))

    return decode


def decode_token(tokenizer: Tokenizer | RustTokenizer, token_id: int) -> str:
    """Text of one token on its own, for ``Logprob.decoded_token``.

    Same as vLLM (``tokenizer.decode([token_id])``): special tokens are kept, a leading-space
    token keeps its space, and a partial UTF-8 byte token shows as U+FFFD.
    """
    return make_decode_fn(tokenizer, skip_special_tokens=False)([token_id])


class _TokenStream:
    """Prefix/read-offset incremental decoder; each step costs O(tokens in the window).

    Invariant: ``_ids[:_read]`` is the context, tokens whose text ``_prefix_text`` has already
    been emitted (or belongs to the prompt); ``_ids[_read:]`` are pending tokens whose text is
    not emitted yet because it is empty (skipped special tokens) or ends in U+FFFD. The context
    starts on a character boundary, so decoding the window and dropping ``_prefix_text`` yields
    exactly the new text.
    """

    def __init__(self, decode: DecodeFn, context_ids: Sequence[int]) -> None:
        self._decode = decode
        self._ids = list(context_ids)
        self._read = len(self._ids)
        self._prefix_text = decode(self._ids)

    def step(self, token_id: int) -> str:
        """Append one token; return its newly complete text ("" while it is incomplete)."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Emit the pending tokens' text as it decodes now (possibly ending in U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._advance(self._decode(self._ids))

    def _advance(self, text: str) -> str:
        piece = text[len(self._prefix_text) :]
        # The tokens just emitted become the whole context: enough for leading-space rules,
        # and it keeps the window (and each decode) a few tokens long.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return piece


def _prompt_context(decode: DecodeFn, prompt_token_ids: Sequence[int]) -> list[int]:
    context = list(prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS) :])
    # A prompt ending mid-character would let the first output token complete a character
    # whose first bytes belong to the prompt; decode the output on its own instead, exactly
    # as tokenizer.decode(output_ids) would.
    if decode(context).endswith(REPLACEMENT_CHAR):
        return []
    return context


def find_earliest_stop(text: str, new_chars: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest-starting stop string that ends within the last ``new_chars`` chars of text.

    Returns ``(start index, stop string)``; on a tie at one start the shorter string wins (it
    completed first). A match ending in the new text starts at most ``len(stop) - 1`` chars
    before it, so only that region is searched.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start != -1 and (best is None or (start, len(stop)) < (best[0], len(best[1]))):
            best = (start, stop)
    return best


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string.

    Only such a suffix can be the start of a stop string that later tokens complete; every
    character before it is safe to release.
    """
    longest = max((len(s) for s in stops), default=0)
    for n in range(min(len(text), longest - 1), 0, -1):
        suffix = text[-n:]
        if any(len(stop) > n and stop.startswith(suffix) for stop in stops):
            return n
    return 0


class IncrementalDetokenizer:
    """Text deltas and stop-string detection for one choice.

    Stop-string semantics: the output's tokens are examined one at a time, so the result never
    depends on how many tokens each ``update`` brings. The first token whose text completes a
    stop string ends the output; if several complete at that token, the earliest-starting one
    wins. Text from the first ``min_tokens`` output tokens never triggers a stop (a stop string
    must end in text of token ``min_tokens + 1`` or later; vLLM's rule). After a match,
    ``num_output_tokens`` stops counting, so ``output_ids[:num_output_tokens]`` are the tokens
    that produced ``output_text``; further updates return "".
    """

    def __init__(
        self,
        tokenizer: Tokenizer | RustTokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        decode = make_decode_fn(tokenizer, params.skip_special_tokens)
        self._stream = _TokenStream(decode, _prompt_context(decode, prompt_token_ids))
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Decoded but unreleased text: always the longest suffix that may begin a stop string
        # (so shorter than the longest stop), and "" when there are no stop strings.
        self._held = ""
        # Released deltas; joined lazily by ``output_text`` so that update stays O(new text).
        self._released: list[str] = []
        self._num_output_tokens = 0
        self._stop_matched: str | None = None

    @property
    def output_text(self) -> str:
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    @property
    def stop_matched(self) -> str | None:
        return self._stop_matched

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Consume newly generated tokens; return the text that is now safe to release."""
        if self._stop_matched is not None:
            return ""
        text = self._held  # unreleased text; grows by each token's piece
        for token_id in new_token_ids:
            self._num_output_tokens += 1
            piece = self._stream.step(token_id)
            text += piece
            end = self._match_stop(text, len(piece))
            if end is not None:
                return self._release(text[:end], hold=0)
        return self._release(text, hold=stop_prefix_len(text, self._stops))

    def flush(self) -> str:
        """Release everything still held; call once when the choice ends for another reason.

        Pending tokens are released as they decode now, so a generation cut mid-character ends
        in U+FFFD exactly like ``tokenizer.decode`` of the same ids (vLLM instead drops the
        partial character). The released tail is still checked for stop strings.
        """
        if self._stop_matched is not None:
            return ""
        piece = self._stream.flush()
        text = self._held + piece
        end = self._match_stop(text, len(piece))
        return self._release(text if end is None else text[:end], hold=0)

    def _match_stop(self, text: str, new_chars: int) -> int | None:
        """If a stop string ends in the last ``new_chars`` chars, record it; return the cut."""
        if not new_chars or not self._stops or self._num_output_tokens <= self._min_tokens:
            return None
        match = find_earliest_stop(text, new_chars, self._stops)
        if match is None:
            return None
        start, stop = match
        self._stop_matched = stop
        return start + len(stop) if self._include_stop else start

    def _release(self, text: str, hold: int) -> str:
        """Release all of ``text`` but its last ``hold`` chars, which stay held."""
        cut = len(text) - hold
        delta, self._held = text[:cut], text[cut:]
        if delta:
            self._released.append(delta)
        return delta
