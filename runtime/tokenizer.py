"""Tokenizer loading and chat-template rendering (both delegated to transformers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Tokenizer(Protocol):
    """What tokenwire uses of a transformers tokenizer (``PreTrainedTokenizerBase``)."""

    chat_template: Any

    def __call__(self, text: Any, add_special_tokens: bool = True) -> Any: ...

    def __len__(self) -> int: ...

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> Any: ...

    def convert_ids_to_tokens(self, ids: Any) -> Any: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


# Any of these in a directory means transformers can build a tokenizer from it.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
    """Load the tokenizer stored in directory ``path``; None when it holds no tokenizer."""
    folder = Path(path)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(folder)
    return tokenizer


def apply_chat_template(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Render ``messages`` with the model's chat template (plus generation prompt) to ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model's tokenizer has no chat template")
    rendered: Any = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
    )
    # transformers 5 may return a BatchEncoding/dict instead of a plain list.
    if isinstance(rendered, Mapping):
        rendered = rendered["input_ids"]
    if hasattr(rendered, "tolist"):
        rendered = rendered.tolist()
    if rendered and isinstance(rendered[0], list):
        rendered = rendered[0]
    return [int(t) for t in rendered]
