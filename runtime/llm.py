"""Offline API shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams)``.

``sampling_params=None`` means the model's default sampling parameters
(``get_default_sampling_params``: ``--generation-config``, as in vLLM), and chat renders with
``chat_template=`` if given, else ``--chat-template``, else the tokenizer's own.

The text side is the served engine's: a ``Frontend`` built from the ``EngineInfo`` the core
publishes (its tokenizer loaded here from ``tokenizer_path``, never taken from the executor)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, cast

from tqdm import tqdm

from tokenwire.runtime.core.kv_events import KVEventBatch
from tokenwire.runtime.engine.core import EngineCore
from tokenwire.runtime.engine.core_loop import engine_info
from tokenwire.runtime.engine_args import EngineArgs
from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.frontend import Frontend
from tokenwire.runtime.front.output_processor import ProcessedStep
from tokenwire.runtime.front.score_pairs import TextOrTexts, encode_pair, pair_texts, score_params
from tokenwire.runtime.front.tokenizer import Tokenizer
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.multimodal import ImageInput
from tokenwire.runtime.outputs import (
    ChoiceDelta,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenwire.runtime.sampling_params import SamplingParams, embedding_params, normalize_params
from tokenwire.runtime.stats import EngineObserver

# vLLM's prompt shapes: text, token ids, or a dict with "prompt" (text) or "prompt_token_ids"
# and optionally "multi_modal_data": {"image": one PIL image or a list of them} and
# "cache_salt" (a string: only prompts of the same salt share prefix-cache blocks and images).
Prompt = str | list[int] | dict[str, Any]
Messages = list[dict[str, str]]


class LLM:
    """An in-process engine for batch generation. Not thread-safe."""

    def __init__(
        self, model: str | None = None, *, observer: EngineObserver | None = None, **kwargs: Any
    ) -> None:
        """``kwargs``: any ``EngineArgs`` field (the ``tokenwire serve`` flags, snake_case:
        ``max_model_len=``, ``num_gpu_blocks_override=``, ...); an unknown one is a
        ``TypeError``, a bad value a ``ValueError`` naming its flag."""
        config = EngineArgs(model=model, **kwargs).create_engine_config()
        if config.parallel.data_parallel_size > 1:
            raise ValueError(
                "--data-parallel-size > 1 runs several engine cores behind a server's front: "
                "use `tokenwire serve`; the offline engine is one core"
            )
        self.engine = EngineCore(config, observer)
        info = engine_info(self.engine)  # what the core publishes to a served front
        self.frontend = Frontend.from_info(info)
        self.default_sampling = info.default_sampling
        # A vision-language model: its image processor and placeholder expansion (the front's).
        self.images = self.frontend.images
        self._counter = itertools.count()
        # With --kv-events-config: each step's KV-cache events, the last buffer_steps kept.
        events = config.kv_events_config
        self.kv_events: deque[KVEventBatch] | None = None
        if events is not None and events.enable_kv_cache_events:
            self.kv_events = deque(maxlen=events.buffer_steps)

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, observer: EngineObserver | None = None
    ) -> LLM:
        fields = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}
        return cls(observer=observer, **fields)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.frontend.tokenizer

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``sampling_params=None`` means: ``SamplingParams()`` with the model's
        generation-config defaults (vLLM's method of the same name)."""
        return SamplingParams(**self.default_sampling)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism). Worker processes also
        exit on their own when this process ends."""
        self.frontend.close()
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order.

        ``lora_request``: the adapter for every prompt, or one per prompt (None: the base
        model), as in vLLM. An adapter the engine does not know yet is loaded by name and
        path first (its ``lora_int_id`` is then the engine's own). A dict prompt may carry
        images (``multi_modal_data``; a vision-language model): each image placeholder token
        of the prompt stands for one image, in order, and is expanded as HF's processor does;
        and a ``cache_salt`` (vLLM's): cached KV blocks and encoded images are shared only
        between prompts of the same salt."""
        single = isinstance(prompts, str | dict)
        prompt_list = [cast(Prompt, prompts)] if single else list(cast(Sequence[Prompt], prompts))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = normalize_params(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ParameterError("priority", "needs one value per prompt")
        loras = self._loras(lora_request, len(prompt_list))
        request_ids: list[str] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompt_list, params, strict=True)):
                salt = _cache_salt(prompt)
                text, token_ids, images = self._inputs(prompt)
                prio = 0 if priority is None else priority[i]
                request_ids.append(self._add(text, token_ids, sp, prio, loras[i], images, salt))
        except Exception:
            for request_id in request_ids:  # all or nothing: drop what this call queued
                self._abort(request_id)
            raise
        results = self._run(use_tqdm and len(request_ids) > 1, len(request_ids))
        return [results[rid] for rid in request_ids]

    def embed(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        *,
        dimensions: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (an embedding model: ``--task embed``); input order kept.
        ``dimensions``: Matryoshka truncation (renormalized when the pooler normalizes)."""
        prompt_list: list[Prompt] = [prompts] if isinstance(prompts, str) else list(prompts)
        params = embedding_params(dimensions)
        request_ids: list[str] = []
        try:
            for prompt in prompt_list:
                text, token_ids = self._tokenize(prompt)
                request_ids.append(self._add(text, token_ids, params, 0))
        except Exception:
            for request_id in request_ids:
                self._abort(request_id)
            raise
        results = self._run(use_tqdm and len(request_ids) > 1, len(request_ids))
        out = []
        for rid in request_ids:
            result = results[rid]
            assert result.embedding is not None
            vector = EmbeddingOutput(result.embedding)
            out.append(EmbeddingRequestOutput(rid, result.prompt_token_ids, vector))
        return out

    def score(
        self, text_1: TextOrTexts, text_2: TextOrTexts, *, use_tqdm: bool = True
    ) -> list[ScoringRequestOutput]:
        """Score text pairs with a cross-encoder (``--task score``): one ``text_1`` against
        every ``text_2``, or two equal-length lists paired by index; pair order kept."""
        tokenizer = self.frontend.tokenizer
        if tokenizer is None:
            raise ParameterError("text_1", "this model has no tokenizer")
        request_ids: list[str] = []
        try:
            for first, second in pair_texts(text_1, text_2):
                token_ids, start = encode_pair(tokenizer, first, second)
                request_ids.append(self._add(None, token_ids, score_params(start), 0))
        except Exception:
            for request_id in request_ids:
                self._abort(request_id)
            raise
        results = self._run(use_tqdm and len(request_ids) > 1, len(request_ids))
        return [
            ScoringRequestOutput(
                rid, results[rid].prompt_token_ids, ScoringOutput((results[rid].embedding or [])[0])
            )
            for rid in request_ids
        ]

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with ``chat_template`` (Jinja text) if given, else the
        model's chat template (``--chat-template`` or the tokenizer's), then generate."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = (
            [cast(Messages, messages)] if single else list(cast(Sequence[Messages], messages))
        )
        self.frontend.require_tokenizer("messages")
        prompts = [
            self.frontend.render_chat(conv, chat_template=chat_template) for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[ChoiceDelta]:
        """Generate one prompt, yielding per-step deltas (the CLI streams text from these)."""
        text, token_ids = self._tokenize(prompt)
        params = sampling_params or self.get_default_sampling_params()
        request_id = self._add(text, token_ids, params, 0)
        try:
            while self.frontend.has_unfinished_requests():
                step = self._step()
                yield from (d for d in step.deltas if d.request_id == request_id)
        finally:
            self._abort(request_id)

    # ------------------------------------------------------------------ internals
    def _loras(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
    ) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            requested: list[LoRARequest | None] = [lora_request] * count
        else:
            requested = list(lora_request)
            if len(requested) != count:
                raise ParameterError("lora_request", "needs one value (or None) per prompt")
        resolved: list[LoRARequest | None] = []
        for request in requested:
            if request is None:
                resolved.append(None)
                continue
            known = self.engine.get_lora(request.lora_name)
            if known is None:
                known = self.engine.add_lora(request.lora_name, request.lora_path)
            resolved.append(known)
        return resolved

    def _inputs(self, prompt: Prompt) -> tuple[str | None, list[int], tuple[ImageInput, ...]]:
        """(text, token ids with image placeholders expanded, the images)."""
        images: Any = []
        if isinstance(prompt, dict):
            images = (prompt.get("multi_modal_data") or {}).get("image", [])
            text, token_ids = self._tokenize(prompt.get("prompt", prompt.get("prompt_token_ids")))
        else:
            text, token_ids = self._tokenize(prompt)
        images = images if isinstance(images, list | tuple) else [images]
        if self.images is None:
            if images:
                raise ParameterError("multi_modal_data", "this model takes no image inputs")
            return text, token_ids, ()
        expanded, inputs = self.images.expand(token_ids, images)
        return text, expanded, inputs

    def _tokenize(self, prompt: Prompt | None) -> tuple[str | None, list[int]]:
        if prompt is None or isinstance(prompt, dict):
            raise ParameterError("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.frontend.encode(prompt)
        return None, list(prompt)

    def _add(
        self,
        prompt: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        lora: LoRARequest | None = None,
        images: tuple[ImageInput, ...] = (),
        cache_salt: str | None = None,
    ) -> str:
        # The constraint parses (limits first, on a worker under a time limit); the engine
        # compiles it.
        self.frontend.check_constraint(params)
        request_id = str(next(self._counter))
        children = self.frontend.add_request(request_id, prompt, token_ids, params)
        try:
            for child_id, child_params in children:
                self.engine.add_request(
                    child_id,
                    token_ids,
                    child_params,
                    priority=priority,
                    lora_request=lora,
                    images=images,
                    cache_salt=cache_salt,
                )
        except Exception:
            self._abort(request_id)
            raise
        return request_id

    def _abort(self, request_id: str) -> None:
        self.engine.abort_requests(self.frontend.abort(request_id))

    def _step(self) -> ProcessedStep:
        step = self.frontend.process(self.engine.step())
        if self.kv_events is not None and (events := self.engine.take_kv_events()):
            self.kv_events.append(KVEventBatch(ts=time.time(), events=events))
        if step.to_abort:
            self.engine.abort_requests(step.to_abort)
        return step

    def _run(self, use_tqdm: bool, total: int) -> dict[str, RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(total=total, desc="generate", disable=not use_tqdm, unit="req") as bar:
            while self.frontend.has_unfinished_requests():
                for output in self._step().finished:
                    results[output.request_id] = output
                    bar.update(1)
        return results


def _cache_salt(prompt: Prompt) -> str | None:
    """A dict prompt's ``cache_salt``: a non-empty string, or absent/None."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ParameterError("cache_salt", "must be a non-empty string")
    return salt
