"""``Frontend``: the front's text pipeline, one for the served engine and the offline ``LLM``.

``AsyncEngine`` (async, over a core client) and ``LLM`` (sync, over an in-process core) each
hold one; so does nothing else. It is sync and plain: no event loop, no streams. It owns

- the tokenizer, loaded from the engine's published ``EngineInfo`` (``tokenizer_path``, with
  ``chat_template`` set on it), the same way in every front: never taken from the executor;
- text in: ``encode`` and ``render_chat`` (user and tool content with special-token text
  stays text, unless ``--allow-content-special-tokens``: ``front/chat_content.py``), and
  ``render_chat_images`` for a vision-language model's chats with images (``images``: its
  image processor; ``front/chat_images.py``). These touch only the tokenizer and the image
  processor and are safe on any thread: the server runs them on its ``TokenizerPool``, never
  on its event loop;
- request checks: ``add_request`` checks the prompt and parameters against the model's
  vocabulary and context and runs the cheap structured-output checks; ``structured`` also
  parses constraints (``check_constraint`` blocks; ``AsyncEngine`` awaits
  ``structured.check_async`` instead);
- ``n > 1`` fan-out and the bookkeeping of each request's choices: ``add_request`` returns the
  child requests to send to the core, ``process`` turns core outputs into deltas and final
  outputs, ``abort`` forgets a request and names the choices to abort in the core.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.bad_words import resolve_bad_words
from tokenwire.runtime.front.chat_images import render_chat_images
from tokenwire.runtime.front.images import ImagePrompter
from tokenwire.runtime.front.output_processor import OutputProcessor, ProcessedStep
from tokenwire.runtime.front.processed_images import ProcessedImageCache
from tokenwire.runtime.front.structured_validate import StructuredValidator
from tokenwire.runtime.front.tokenizer import Tokenizer, apply_chat_template, load_tokenizer
from tokenwire.runtime.front.validation import validate_request
from tokenwire.runtime.multimodal import ImageInput
from tokenwire.runtime.outputs import EngineCoreOutput
from tokenwire.runtime.sampling_params import SamplingParams


class PublishedInfo(Protocol):
    """What a front reads of the facts its engine publishes (``EngineInfo`` has these): named
    structurally so the front does not import the engine seam that hands it out."""

    @property
    def tokenizer_path(self) -> str | None: ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def allow_content_special_tokens(self) -> bool: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def model_path(self) -> str: ...


class Frontend:
    """The text side of one engine front. Not thread-safe, except ``encode`` and
    ``render_chat`` (the tokenizer only)."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        *,
        vocab_size: int,
        max_model_len: int,
        split_special_tokens: bool = True,
        images: ImagePrompter | None = None,
    ) -> None:
        """``split_special_tokens``: special-token text in user and tool content is text
        (False: ``--allow-content-special-tokens``); ``images``: a vision-language model's
        image processor and placeholder expansion (None: the model takes no images)."""
        self.tokenizer = tokenizer
        self.images = images
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.split_special_tokens = split_special_tokens
        # ``limits`` may be replaced while serving (tests do).
        self.structured = StructuredValidator(has_tokenizer=tokenizer is not None)
        self._processor = OutputProcessor(tokenizer)

    @classmethod
    def from_info(cls, info: PublishedInfo) -> Frontend:
        """The front of the engine that published ``info``: its tokenizer loaded here (a
        blocking load: ``AsyncEngine`` calls this on a thread)."""
        tokenizer = None
        if info.tokenizer_path is not None:
            tokenizer = load_tokenizer(info.tokenizer_path, info.chat_template)
        images = ImagePrompter.from_model_dir(info.model_path) if info.model_path else None
        return cls(
            tokenizer,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            split_special_tokens=not info.allow_content_special_tokens,
            images=images,
        )

    def close(self) -> None:
        self.structured.close()

    # ------------------------------------------------------------------ text in
    def require_tokenizer(self, param: str) -> Tokenizer:
        """The tokenizer; ``ParameterError`` naming ``param`` when the model has none."""
        if self.tokenizer is None:
            raise ParameterError(param, "this model has no tokenizer: pass token ids instead")
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of prompt ``text``."""
        tokenizer = self.require_tokenizer("prompt")
        # The batch form releases the interpreter lock for the whole encode (measured: the
        # loop thread waited at most 48 ms while 6 MB were encoded, vs 95 ms for the single
        # form); the ids are the same.
        ids = tokenizer([text], add_special_tokens=add_special_tokens)["input_ids"][0]
        return list(ids)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Ids of ``messages`` rendered with the chat template (plus the generation prompt):
        ``chat_template`` (Jinja text) if given, else the model's; ``template_kwargs``: extra
        template variables (``enable_thinking``, ``reasoning_effort``). ``ValueError`` when there
        is no template; ``ParameterError`` naming ``messages`` when there is no tokenizer."""
        return apply_chat_template(
            self.require_tokenizer("messages"),
            messages,
            tools,
            chat_template=chat_template,
            split_special_tokens=self.split_special_tokens,
            template_kwargs=template_kwargs,
        )

    def render_chat_images(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        max_pixels: int,
        template_kwargs: Mapping[str, Any] | None = None,
        cache: ProcessedImageCache | None = None,
        cache_salt: str | None = None,
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """A chat whose user contents hold image parts (``chat_images``): (ids with each
        image's placeholder run, the images); blocking (decode, processor): off the loop.
        ``cache``: the caller's processed images (``TokenizerPool`` holds one), thread-safe,
        shared only by requests of one ``cache_salt``."""
        return render_chat_images(
            self.require_tokenizer("messages"),
            self.images,
            messages,
            tools,
            max_pixels=max_pixels,
            template_kwargs=template_kwargs,
            cache=cache,
            cache_salt=cache_salt,
        )

    # ------------------------------------------------------------------ requests
    def check_constraint(self, params: SamplingParams) -> None:
        """Every structured-output check of ``params``, blocking (the offline ``LLM``)."""
        self.structured.check(params)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> list[tuple[str, SamplingParams]]:
        """Check the request and register it; returns the (child id, params) pairs to send to
        the core. Raises before anything is registered. No grammar work here: a constraint
        not known to parse is left to ``check_constraint`` or the core's compile pool.
        ``bad_words`` are tokenized here: the core gets their token ids."""
        params = resolve_bad_words(self.tokenizer, params)
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        self.structured.check_known(params)
        return self._processor.add_request(request_id, prompt, prompt_token_ids, params)

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedStep:
        """One step of core outputs -> deltas, finished requests and the choices that matched
        a stop string (``to_abort``: the caller aborts them in the core)."""
        return self._processor.process(outputs)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its unfinished child ids (to abort in the core)."""
        return self._processor.abort(request_id)

    def unfinished_children(self, request_id: str) -> list[str]:
        return self._processor.unfinished_children(request_id)

    def parent_of(self, child_id: str) -> str | None:
        """The request id of a core-side choice id still being tracked."""
        return self._processor.parent_of(child_id)

    def has_unfinished_requests(self) -> bool:
        return self._processor.has_unfinished_requests()
