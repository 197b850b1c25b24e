"""``Tokenizer``: the members of a transformers tokenizer that tokenwire calls (a Protocol).

Its own module so the chat-content helpers that ``tokenizer`` uses can name it without an
import circle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class Tokenizer(Protocol):
    """What tokenwire calls on a tokenizer: the members of transformers'
    ``PreTrainedTokenizerBase`` that the engine front, the gRPC services and the offline ``LLM``
    use (encode, decode, token strings, chat template). Nothing else may be assumed."""

    @property
    def chat_template(self) -> str | dict[str, str] | None: ...  # Jinja text, or named ones

    @property
    def added_tokens_decoder(self) -> Mapping[int, Any]: ...  # id -> AddedToken

    def __call__(
        self,
        text: str | list[str],
        text_pair: str | None = None,
        *,
        add_special_tokens: bool = True,
        split_special_tokens: bool = False,
    ) -> Mapping[str, Any]: ...  # a BatchEncoding: ["input_ids"] holds the ids

    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = False
    ) -> str | list[str]: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> str | list[str]: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> object: ...
