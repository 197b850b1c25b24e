"""Tokenizer loading and chat-template rendering (both delegated to transformers).

``--chat-template`` (vLLM's flag) replaces the tokenizer's own template: ``load_chat_template``
reads it (a file, or the template inline) and ``load_tokenizer(..., chat_template=...)`` sets it
on the tokenizer, so every renderer (gRPC chat, the OpenAI shim through gRPC, ``LLM.chat``,
tool-call detection) sees the same template.
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenwire.runtime.front.chat_content import forged_token, render_plain_content
from tokenwire.runtime.front.tokenizer_type import Tokenizer as Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# Any of these in a directory means transformers can build a tokenizer from it.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)


def load_tokenizer(
    path: str | Path, chat_template: str | None = None
) -> PreTrainedTokenizerBase | None:
    """Load the tokenizer stored in directory ``path``; None when it holds no tokenizer.
    ``chat_template`` (the Jinja text) replaces the tokenizer's own."""
    folder = Path(path)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(folder)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


# An argument with none of these characters names a file (vLLM's rule).
_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: the contents of file ``value``, else ``value`` itself as an inline
    template (escapes such as ``\\n`` decoded, as vLLM does). A path that cannot be read, or
    a template Jinja cannot parse, is a ``ValueError`` naming ``chat_template``."""
    if value is None:
        return None
    try:
        text = Path(value).expanduser().read_text()
    except (OSError, ValueError) as exc:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(
                f"chat_template: {value!r} looks like a file path, but it cannot be read ({exc})"
            ) from None
        # latin-1 + backslashreplace keeps non-ASCII characters through unicode_escape.
        text = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: not a valid Jinja template: {exc}") from None
    return text


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    chat_template: str | None = None,
    split_special_tokens: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
    image: tuple[str, int] | None = None,
) -> list[int]:
    """Render ``messages`` with the model's chat template (plus generation prompt) to ids;
    ``tools`` (OpenAI tool objects) go to templates that take them; ``chat_template`` (Jinja
    text) replaces the tokenizer's for this call.

    ``split_special_tokens`` (the default): special-token text inside a user or tool message
    is plain text, never a special token, so content cannot forge a turn
    (``runtime/front/chat_content.py``); False parses it like the template's own (the old way,
    ``--allow-content-special-tokens``). ``template_kwargs``: extra template variables.
    ``image``: (marker, token id): the contents hold image markers (``chat_images``); they
    render the split way, whatever ``split_special_tokens`` says."""
    if not (chat_template or tokenizer.chat_template):
        raise ValueError("messages: this model's tokenizer has no chat template")
    extra: dict[str, Any] = dict(template_kwargs or {})  # checked by the caller: no reserved keys
    if tools:
        extra["tools"] = [dict(t) for t in tools]
    if chat_template:
        extra["chat_template"] = chat_template
    if image is not None or (split_special_tokens and forged_token(messages, tokenizer)):
        return render_plain_content(tokenizer, messages, extra, image)
    rendered: Any = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=True, **extra
    )
    # transformers 5 may return a BatchEncoding/dict instead of a plain list.
    if isinstance(rendered, Mapping):
        rendered = rendered["input_ids"]
    if hasattr(rendered, "tolist"):
        rendered = rendered.tolist()
    if rendered and isinstance(rendered[0], list):
        rendered = rendered[0]
    return [int(t) for t in rendered]
