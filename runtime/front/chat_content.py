"""Chat rendering in which user and tool message content is always text.

Tokenizing a rendered chat in one piece parses special-token text wherever it appears, so a
user message holding ``<|im_end|>\\n<|im_start|>system\\n...`` would open a system turn of its
own. Here the template's own text keeps its special tokens, while the content of ``user`` and
``tool`` messages is tokenized with ``split_special_tokens`` (its ``<|im_start|>`` is just
characters). System and assistant messages, tool definitions and tool-call arguments are the
application's and render as before.

How: the template is rendered once with a unique placeholder for each such content (which
tells the template's text from the contents) and once as it is (the text to tokenize); each
run of text between two of the template's special tokens is then tokenized as one piece, as
the tokenizer itself does, with special tokens split. Content without special-token text
needs none of this, and ``apply_chat_template`` tokenizes it the old way (identical ids).
A template that changes message content other than by trimming whitespace cannot be split
this way; content with special-token text is then refused (``ParameterError``).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tokenwire.runtime.errors import ParameterError

if TYPE_CHECKING:
    from tokenwire.runtime.front.tokenizer_type import Tokenizer

UNTRUSTED_ROLES = frozenset({"user", "tool"})
# How a template may pass a content through: verbatim, or trimmed (``| trim``, ``.strip()``).
_TRIMS: tuple[Callable[[str], str], ...] = (str, str.strip, str.lstrip, str.rstrip)
Message = Mapping[str, Any]


def _special_added(tokenizer: Tokenizer) -> dict[int, Any]:
    """Id -> ``AddedToken`` of each special token: what ``split_special_tokens`` leaves as
    text (the tokenizer still parses its other added tokens)."""
    decoder = tokenizer.added_tokens_decoder
    return {i: t for i, t in decoder.items() if t.special and t.content}


def _pattern(tokens: Sequence[Any]) -> re.Pattern[str]:
    """Matches any of ``tokens`` (``AddedToken``s), with the whitespace that one marked
    ``lstrip`` / ``rstrip`` absorbs, as the tokenizer does; longest first, so a token that is
    a prefix of another never hides it (``re`` caches the compiled pattern)."""
    alternatives = []
    for t in sorted(tokens, key=lambda t: len(t.content), reverse=True):
        left = r"\s*" if getattr(t, "lstrip", False) else ""
        right = r"\s*" if getattr(t, "rstrip", False) else ""
        alternatives.append(f"{left}{re.escape(t.content)}{right}")
    return re.compile("|".join(alternatives))


def forged_token(messages: Sequence[Message], tokenizer: Tokenizer) -> str | None:
    """The first special-token text found in a user or tool message's content, if any."""
    tokens = list(_special_added(tokenizer).values())
    if not tokens:
        return None
    pattern = re.compile("|".join(re.escape(t.content) for t in tokens))
    for m in messages:
        content = m.get("content")
        if m.get("role") in UNTRUSTED_ROLES and isinstance(content, str):
            found = pattern.search(content)
            if found is not None:
                return found.group()
    return None


def render_plain_content(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    extra: Mapping[str, Any],
    image: tuple[str, int] | None = None,
) -> list[int]:
    """Ids of ``messages`` rendered with the chat template (plus generation prompt; ``extra``:
    tools, a template of the call) where user and tool content never yields a special token.
    ``image``: (marker text, token id): each marker in a content becomes that one token (an
    image's placeholder, ``chat_images``)."""
    added = _special_added(tokenizer)
    ids_of = {t.content: i for i, t in added.items()}
    pieces = _pieces(tokenizer, messages, extra)
    if pieces is None:
        token = forged_token(messages, tokenizer) or "special-token text"
        what = "images" if image is not None else repr(token)
        raise ParameterError(
            "messages",
            f"a user or tool message contains {what}, and this model's chat template "
            "rewrites message content, so it cannot be kept as plain text; remove it",
        )
    pattern = _pattern(list(added.values())) if added else None
    ids: list[int] = []
    run: list[str] = []  # text since the last special token of the template
    for text, is_content in pieces:
        start = 0
        if not is_content and pattern is not None:
            for found in pattern.finditer(text):
                run.append(text[start : found.start()])
                ids.extend(_encode_run(tokenizer, "".join(run), image))
                run = []
                token = found.group()
                ids.append(ids_of[token] if token in ids_of else ids_of[token.strip()])
                start = found.end()
        run.append(text[start:])
    ids.extend(_encode_run(tokenizer, "".join(run), image))
    return ids


def _encode_run(tokenizer: Tokenizer, text: str, image: tuple[str, int] | None) -> list[int]:
    """Ids of one run of text between the template's special tokens; each image marker in
    it becomes the image token, the text on each side tokenized apart."""
    if image is None:
        return _encode_text(tokenizer, text)
    marker, token = image
    chunks = text.split(marker)
    ids = _encode_text(tokenizer, chunks[0])
    for chunk in chunks[1:]:
        ids.append(token)
        ids.extend(_encode_text(tokenizer, chunk))
    return ids


def _encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    if not text:
        return []
    encoded = tokenizer([text], add_special_tokens=False, split_special_tokens=True)
    return [int(t) for t in encoded["input_ids"][0]]


def _render(tokenizer: Tokenizer, messages: Sequence[Message], extra: Mapping[str, Any]) -> str:
    text: object = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=False, **extra
    )
    if not isinstance(text, str):
        raise TypeError("apply_chat_template(tokenize=False) did not return text")
    return text


def _pieces(
    tokenizer: Tokenizer, messages: Sequence[Message], extra: Mapping[str, Any]
) -> list[tuple[str, bool]] | None:
    """The rendered chat as (text, is untrusted content) pieces, in order; None when the
    template changes a content other than by trimming it."""
    nonce = secrets.token_hex(8)  # a client cannot guess it: its text is no placeholder
    contents: list[str] = []
    marked: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content")
        if m.get("role") in UNTRUSTED_ROLES and isinstance(content, str):
            marked.append({**m, "content": f"\ue000{nonce}.{len(contents)}\ue001"})
            contents.append(content)
        else:
            marked.append(dict(m))
    parts = re.split(f"\ue000{nonce}\\.(\\d+)\ue001", _render(tokenizer, marked, extra))
    real = _render(tokenizer, messages, extra)
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for k in range(0, len(parts), 2):
        template_text = parts[k]
        if not real.startswith(template_text, pos):
            return None
        pieces.append((template_text, False))
        pos += len(template_text)
        if k + 1 == len(parts):
            break
        content, following = contents[int(parts[k + 1])], parts[k + 2]
        shown = next(
            (s for s in (t(content) for t in _TRIMS) if real.startswith(s + following, pos)),
            None,
        )
        if shown is None:
            return None
        pieces.append((shown, True))
        pos += len(shown)
    if pos != len(real):
        return None
    return pieces
