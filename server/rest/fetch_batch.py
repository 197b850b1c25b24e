"""One request's remote images fetched together (``--allowed-media-domains``).

The images of a request are fetched concurrently, at most ``policy.max_in_flight`` at once,
all under ONE deadline (``policy.timeout``: five hanging images are refused after it, not after
five times it). Each fetch is ``media_fetch.fetch_checked`` (allow-list, private addresses
refused, pinned address, no redirects, ``--max-image-bytes``).

The fetched bytes count, with the request body's own size, against
``policy.max_request_bytes`` (``--max-request-body-bytes``): the part that crosses it is the
first in request order whose running sum (body, then each image's bytes in part order)
passes the limit.

The error is deterministic: the 400 names the lowest-index part that failed. When a part
fails, every part after it is cancelled (its outcome cannot matter) and the parts before it
run on, to the deadline: one of them may fail too, and then it is named. A part still
unfinished at the deadline has failed by timing out. When ``fetch_all`` returns or raises, no
fetch of it is left running (a ``TaskGroup`` holds them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from tokenwire.server.rest.errors import RestError, invalid
from tokenwire.server.rest.media_fetch import (
    FetchedImage,
    MediaFetchPolicy,
    checked_url,
    fetch_checked,
)

BODY_FLAG = "--max-request-body-bytes"


@dataclass(frozen=True)
class ImageJob:
    param: str  # where the URL is: ``messages.<i>.content.<j>``, ``input.<i>.content.<j>``
    url: str


class _Cut(Exception):
    """A part before this one has failed: this fetch's outcome cannot matter; stop it."""


class _Batch:
    """The state of one ``fetch_all``: each part's bytes so far, result, and the lowest
    failure (``cut``: the parts from it on are cancelled)."""

    def __init__(self, jobs: Sequence[ImageJob], policy: MediaFetchPolicy, body_bytes: int):
        self.jobs = jobs
        self.policy = policy
        self.body_bytes = body_bytes
        self.results: list[FetchedImage | None] = [None] * len(jobs)
        self.sizes = [0] * len(jobs)
        self.cut = len(jobs)
        self.error: RestError | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.slots = asyncio.Semaphore(policy.max_in_flight)

    def fail(self, index: int, error: RestError) -> None:
        """Part ``index`` failed: if it is the lowest so far, it is named, and the fetches of
        the parts after it are cancelled (not the caller's own: it raises ``_Cut``)."""
        if index >= self.cut:
            return
        self.cut, self.error = index, error
        current = asyncio.current_task()
        for task in self.tasks[index:]:
            if task is not current:
                task.cancel()

    def count(self, index: int, size: int) -> None:
        """``size`` more bytes of part ``index``; the first part (in request order) whose
        running sum passes the request's limit fails."""
        self.sizes[index] += size
        limit = self.policy.max_request_bytes
        if limit is not None:
            total = self.body_bytes
            for i in range(self.cut):
                total += self.sizes[i]
                if total > limit:
                    self.fail(i, _over_request_limit(self.jobs[i].param, limit))
                    break
        if index >= self.cut:
            raise _Cut

    async def run(self, index: int) -> None:
        job = self.jobs[index]
        try:
            parsed = checked_url(job.url, self.policy, job.param)
            async with self.slots:
                if index >= self.cut:
                    return
                counter = partial(self.count, index)
                self.results[index] = await fetch_checked(parsed, self.policy, job.param, counter)
        except RestError as error:
            self.fail(index, error)
        except _Cut:
            pass

    def time_out(self) -> None:
        """The deadline passed: the first part not fetched by then has failed."""
        for index in range(self.cut):
            if self.results[index] is None:
                message = f"fetching the request's image URLs took over {self.policy.timeout:g}s"
                self.fail(index, invalid(self.jobs[index].param, message))
                return


async def fetch_all(
    jobs: Sequence[ImageJob], policy: MediaFetchPolicy, body_bytes: int = 0
) -> list[FetchedImage]:
    """The image of each job, in order; else the 400 of the lowest-index part that failed.

    ``body_bytes``: the request body's own size, counted with the fetched bytes against
    ``policy.max_request_bytes``."""
    batch = _Batch(jobs, policy, body_bytes)
    try:
        async with asyncio.timeout(policy.timeout), asyncio.TaskGroup() as group:
            for index in range(len(jobs)):
                batch.tasks.append(group.create_task(batch.run(index)))
    except TimeoutError:
        batch.time_out()
    except BaseExceptionGroup as group_error:  # a bug in a fetch: raise it as itself
        raise group_error.exceptions[0] from None
    if batch.error is not None:
        raise batch.error
    return [image for image in batch.results if image is not None]


def _over_request_limit(param: str, limit: int) -> RestError:
    return invalid(
        param,
        f"the request's body and the images fetched for it come to over {limit} bytes "
        f"({BODY_FLAG}); this image crossed it",
    )


__all__ = ["BODY_FLAG", "ImageJob", "fetch_all"]
