"""Tokenizer work (encode, chat templates, decode) off the event loop, on a bounded pool.

A server's event loop must never tokenize: a multi-megabyte prompt takes seconds, and every
other call on the loop (health checks included) would wait for it. ``TokenizerPool`` runs
each job on a small thread pool (HF's Rust tokenizers release the interpreter lock while they
encode) and refuses new jobs with ``QueueFullError`` once ``max_pending`` are queued or
running, so a flood of large prompts cannot queue unbounded work.
Encoding and chat rendering are the engine's ``Frontend``'s (the offline ``LLM``'s too); the
pool only decides where they run.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from tokenwire.runtime.errors import ParameterError, QueueFullError
from tokenwire.runtime.front.chat_images import ImageInput, chat_images
from tokenwire.runtime.front.frontend import Frontend
from tokenwire.runtime.front.processed_images import ProcessedImageCache
from tokenwire.runtime.front.tokenizer import Tokenizer
from tokenwire.server.grpc.images import ImageLimits, check_images

T = TypeVar("T")

# Default prompt-size limit per context token: far more bytes than any tokenizer spends on a
# token on average, so no prompt that fits the context is refused by it.
PROMPT_BYTES_PER_TOKEN = 32


def default_max_prompt_bytes(max_model_len: int) -> int:
    return PROMPT_BYTES_PER_TOKEN * max_model_len


def check_prompt_bytes(param: str, texts: Sequence[str], limit: int) -> None:
    """Refuse prompt text above ``limit`` UTF-8 bytes before any tokenizer work."""
    size = 0
    for text in texts:
        # Characters bound bytes from below: most oversized prompts stop here unencoded.
        size += len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise ParameterError(
                param,
                f"the prompt text exceeds {limit} bytes, the server's limit "
                "(--max-prompt-bytes); send fewer or shorter inputs",
            )


def _texts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every message's text (a list content's text parts)."""
    out: list[str] = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            out.extend(p["text"] for p in content if p.get("type") == "text")
        else:
            out.append(content)
    return out


class TokenizerPool:
    def __init__(
        self,
        frontend: Frontend,
        max_prompt_bytes: int,
        max_workers: int = 2,
        max_pending: int = 64,
        images: ImageLimits | None = None,
    ) -> None:
        if frontend.tokenizer is None:
            raise ValueError("a TokenizerPool needs a model with a tokenizer")
        self.frontend = frontend
        self.tokenizer: Tokenizer = frontend.tokenizer
        self.max_prompt_bytes = max_prompt_bytes
        self.max_pending = max_pending
        self.image_limits = images or ImageLimits()
        # What the image processor made of recent images (--mm-processor-cache-bytes).
        self.processed_images = ProcessedImageCache(self.image_limits.processor_cache_bytes)
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="tokenwire-tok")
        self._lock = threading.Lock()
        self._pending = 0  # jobs queued or running (decremented by the worker when done)

    @property
    def num_pending(self) -> int:
        return self._pending

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the pool; a cancelled caller leaves the job to finish."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise QueueFullError(
                    f"{self._pending} tokenization jobs are queued, the server's limit"
                )
            self._pending += 1
        try:
            job: Future[T] = self._executor.submit(fn, *args)
        except BaseException:
            self._done(None)
            raise
        job.add_done_callback(self._done)
        return await asyncio.wrap_future(job)

    def _done(self, _: object) -> None:
        with self._lock:
            self._pending -= 1

    async def encode(self, param: str, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (the client's field ``param``), size-checked first."""
        check_prompt_bytes(param, [text], self.max_prompt_bytes)
        return await self.run(self.frontend.encode, text, add_special_tokens)

    async def render_chat(
        self,
        param: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The chat template applied to ``messages`` (with the generation prompt);
        ``template_kwargs``: extra template variables (already checked)."""
        check_prompt_bytes(param, _texts(messages), self.max_prompt_bytes)
        if not template_kwargs:
            return await self.run(self.frontend.render_chat, messages, tools)
        render = functools.partial(self.frontend.render_chat, template_kwargs=template_kwargs)
        return await self.run(render, messages, tools)

    async def render_chat_images(
        self,
        param: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """A chat with image parts: the limits on count and size first, then decoding (the
        pixel limit before decompressing), the template and the image processor on the pool;
        an image the pool's ``processed_images`` holds for the request's ``cache_salt`` (the
        salt the engine gets: a tenant's isolation) is neither decoded nor processed.
        """
        check_prompt_bytes(param, _texts(messages), self.max_prompt_bytes)
        check_images(chat_images(messages), self.image_limits)
        render = functools.partial(
            self.frontend.render_chat_images,
            max_pixels=self.image_limits.max_pixels,
            template_kwargs=template_kwargs,
            cache=self.processed_images,
            cache_salt=cache_salt,
        )
        return await self.run(render, messages, tools)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
