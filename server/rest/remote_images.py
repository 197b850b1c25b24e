"""Remote image parts of a request, fetched and inlined before it is translated.

With ``--allowed-media-domains`` set, every ``http(s)`` image URL of a chat request
(``messages.<i>.content.<j>``) or a Responses API request (``input.<i>.content.<j>``,
``input.<i>.output.<j>``) is fetched under the ``MediaFetchPolicy`` (``media_fetch``) and
replaced by the same image as a ``data:`` URL, so the one translation path
(``content_parts.image_part``) sends it on as an ``ImagePart``. Without the flag nothing is
fetched and ``image_part`` refuses the URL, naming the flag. The fetches of one request run
one after another (a request carries few images; ``--max-images-per-request``).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

from tokenwire.server.rest.content_parts import ImageUrlPart, TextPart
from tokenwire.server.rest.media_fetch import MediaFetchPolicy, fetch_image, is_remote
from tokenwire.server.rest.models import ChatCompletionRequest
from tokenwire.server.rest.responses_api.models import (
    FunctionCallOutputItem,
    InputImage,
    InputText,
    MessageItem,
    ResponsesRequest,
)


async def _data_url(url: str, policy: MediaFetchPolicy, param: str) -> str:
    image = await fetch_image(url, policy, param)
    return f"data:{image.mime_type};base64,{base64.b64encode(image.data).decode('ascii')}"


async def _chat_parts(
    parts: Sequence[TextPart | ImageUrlPart], policy: MediaFetchPolicy, field: str
) -> list[TextPart | ImageUrlPart] | None:
    """``parts`` with remote images inlined; None when none is remote."""
    out: list[TextPart | ImageUrlPart] = []
    changed = False
    for j, part in enumerate(parts):
        if isinstance(part, ImageUrlPart) and is_remote(part.image_url.url):
            url = await _data_url(part.image_url.url, policy, f"{field}.{j}")
            image_url = part.image_url.model_copy(update={"url": url})
            part = part.model_copy(update={"image_url": image_url})
            changed = True
        out.append(part)
    return out if changed else None


async def inline_chat_images(
    body: ChatCompletionRequest, policy: MediaFetchPolicy
) -> ChatCompletionRequest:
    """``body`` with its remote image URLs fetched into ``data:`` URLs (policy enabled)."""
    if not policy.enabled:
        return body
    messages = list(body.messages)
    changed = False
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        parts = await _chat_parts(message.content, policy, f"messages.{i}.content")
        if parts is not None:
            messages[i] = message.model_copy(update={"content": parts})
            changed = True
    return body.model_copy(update={"messages": messages}) if changed else body


async def _input_parts(
    parts: Sequence[InputText | InputImage], policy: MediaFetchPolicy, field: str
) -> list[InputText | InputImage] | None:
    out: list[InputText | InputImage] = []
    changed = False
    for j, part in enumerate(parts):
        if isinstance(part, InputImage) and part.image_url and is_remote(part.image_url):
            url = await _data_url(part.image_url, policy, f"{field}.{j}")
            part = part.model_copy(update={"image_url": url})
            changed = True
        out.append(part)
    return out if changed else None


async def inline_response_images(
    body: ResponsesRequest, policy: MediaFetchPolicy
) -> ResponsesRequest:
    """``body`` with the remote ``input_image`` URLs of its input items inlined."""
    if not policy.enabled or isinstance(body.input, str):
        return body
    items = list(body.input)
    changed = False
    for i, item in enumerate(items):
        if isinstance(item, MessageItem) and not isinstance(item.content, str):
            parts = await _input_parts(item.content, policy, f"input.{i}.content")
            if parts is not None:
                items[i] = item.model_copy(update={"content": parts})
                changed = True
        elif isinstance(item, FunctionCallOutputItem) and not isinstance(item.output, str):
            parts = await _input_parts(item.output, policy, f"input.{i}.output")
            if parts is not None:
                items[i] = item.model_copy(update={"output": parts})
                changed = True
    return body.model_copy(update={"input": items}) if changed else body


__all__ = ["inline_chat_images", "inline_response_images"]
