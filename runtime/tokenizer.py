"""Tokenizer loading and chat-template rendering (both delegated to transformers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Tokenizer(Protocol):
    """What tokenwire calls on a tokenizer: the members of transformers'
    ``PreTrainedTokenizerBase`` that the engine front, the gRPC services and the offline ``LLM``
    use (encode, decode, token strings, chat template). Nothing else may be assumed."""

    @property
    def chat_template(self) -> str | dict[str, str] | None: ...  # Jinja text, or named ones

    def __call__(
        self, text: str | list[str], *, add_special_tokens: bool = True
    ) -> Mapping[str, Any]: ...  # a BatchEncoding: ["input_ids"] holds the ids

    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = False
    ) -> str | list[str]: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> str | list[str]: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> object: ...


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


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Render ``messages`` with the model's chat template (plus generation prompt) to ids;
    ``tools`` (OpenAI tool objects) go to templates that take them."""
    if not tokenizer.chat_template:
        raise ValueError("messages: this model's tokenizer has no chat template")
    extra: dict[str, Any] = {} if not tools else {"tools": [dict(t) for t in tools]}
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
