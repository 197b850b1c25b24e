"""Remote image parts of a request, fetched and inlined before it is translated.

With ``--allowed-media-domains`` set, every ``http(s)`` image URL of a chat request
(``messages.<i>.content.<j>``) or a Responses API request (``input.<i>.content.<j>``,
``input.<i>.output.<j>``) is fetched under the ``MediaFetchPolicy`` (``media_fetch``) and
replaced by the same image as a ``data:`` URL, so the one translation path
(``content_parts.image_part``) sends it on as an ``ImagePart``. Without the flag nothing is
fetched and ``image_part`` refuses the URL, naming the flag. A request's images are fetched
together (``fetch_batch``: at most ``max_in_flight`` at once, one deadline for them all, their
bytes counted with the body's against ``--max-request-body-bytes``, the lowest failing part
named).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence

from tokenwire.server.rest.content_parts import ImageUrlPart, TextPart
from tokenwire.server.rest.fetch_batch import ImageJob, fetch_all
from tokenwire.server.rest.media_fetch import MediaFetchPolicy, is_remote
from tokenwire.server.rest.models import ChatCompletionRequest
from tokenwire.server.rest.responses_api.models import (
    FunctionCallOutputItem,
    InputImage,
    InputText,
    MessageItem,
    ResponsesRequest,
)


async def _data_urls(
    jobs: list[ImageJob], policy: MediaFetchPolicy, body_bytes: int
) -> dict[str, str]:
    """Each job's ``param`` -> its image as a ``data:`` URL (all fetched, or a 400)."""
    images = await fetch_all(jobs, policy, body_bytes)
    return {
        job.param: f"data:{image.mime_type};base64,{base64.b64encode(image.data).decode('ascii')}"
        for job, image in zip(jobs, images, strict=True)
    }


def _chat_jobs(body: ChatCompletionRequest) -> list[ImageJob]:
    return [
        ImageJob(f"messages.{i}.content.{j}", part.image_url.url)
        for i, message in enumerate(body.messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if isinstance(part, ImageUrlPart) and is_remote(part.image_url.url)
    ]


def _chat_parts(
    parts: Sequence[TextPart | ImageUrlPart], urls: Mapping[str, str], field: str
) -> list[TextPart | ImageUrlPart] | None:
    """``parts`` with the fetched images inlined; None when none of them was fetched."""
    out: list[TextPart | ImageUrlPart] = []
    for j, part in enumerate(parts):
        url = urls.get(f"{field}.{j}")
        if url is not None and isinstance(part, ImageUrlPart):
            image_url = part.image_url.model_copy(update={"url": url})
            part = part.model_copy(update={"image_url": image_url})
        out.append(part)
    return out if any(f"{field}.{j}" in urls for j in range(len(parts))) else None


async def inline_chat_images(
    body: ChatCompletionRequest, policy: MediaFetchPolicy, body_bytes: int = 0
) -> ChatCompletionRequest:
    """``body`` with its remote image URLs fetched into ``data:`` URLs (policy enabled);
    ``body_bytes``: the request body's size, counted with the fetched bytes."""
    jobs = _chat_jobs(body) if policy.enabled else []
    if not jobs:
        return body
    urls = await _data_urls(jobs, policy, body_bytes)
    messages = list(body.messages)
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            parts = _chat_parts(message.content, urls, f"messages.{i}.content")
            if parts is not None:
                messages[i] = message.model_copy(update={"content": parts})
    return body.model_copy(update={"messages": messages})


def _input_lists(body: ResponsesRequest) -> list[tuple[int, str, list[InputText | InputImage]]]:
    """(item index, field, parts) of each input item that carries a list of parts."""
    if isinstance(body.input, str):
        return []
    found: list[tuple[int, str, list[InputText | InputImage]]] = []
    for i, item in enumerate(body.input):
        if isinstance(item, MessageItem) and not isinstance(item.content, str):
            found.append((i, "content", item.content))
        elif isinstance(item, FunctionCallOutputItem) and not isinstance(item.output, str):
            found.append((i, "output", item.output))
    return found


def _input_parts(
    parts: Sequence[InputText | InputImage], urls: Mapping[str, str], field: str
) -> list[InputText | InputImage] | None:
    out: list[InputText | InputImage] = []
    for j, part in enumerate(parts):
        url = urls.get(f"{field}.{j}")
        if url is not None and isinstance(part, InputImage):
            part = part.model_copy(update={"image_url": url})
        out.append(part)
    return out if any(f"{field}.{j}" in urls for j in range(len(parts))) else None


async def inline_response_images(
    body: ResponsesRequest, policy: MediaFetchPolicy, body_bytes: int = 0
) -> ResponsesRequest:
    """``body`` with the remote ``input_image`` URLs of its input items inlined."""
    lists = _input_lists(body) if policy.enabled else []
    jobs = [
        ImageJob(f"input.{i}.{field}.{j}", part.image_url)
        for i, field, parts in lists
        for j, part in enumerate(parts)
        if isinstance(part, InputImage) and part.image_url and is_remote(part.image_url)
    ]
    if not jobs or isinstance(body.input, str):
        return body
    urls = await _data_urls(jobs, policy, body_bytes)
    items = list(body.input)
    for i, field, parts in lists:
        new = _input_parts(parts, urls, f"input.{i}.{field}")
        if new is not None:
            items[i] = items[i].model_copy(update={field: new})
    return body.model_copy(update={"input": items})


__all__ = ["inline_chat_images", "inline_response_images"]
