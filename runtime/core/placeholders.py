"""Async scheduling's scheduler-side bookkeeping: placeholders for tokens still in flight.

Under async scheduling the engine schedules step k+1 before step k's sampled tokens are back.
Right after ``schedule()`` it calls ``advance``: every scheduled request's
``num_computed_tokens`` moves past the tokens just scheduled (the forward will have computed
them by the time any later step runs: the worker runs steps in order), and each request the
step brings up to date (it samples) gets one output placeholder. The next ``schedule()``
counts placeholders as known tokens (one decode token each: the worker feeds it its own
step-k sample), and ``update(..., advanced=True)`` turns a placeholder into the real token.

A request whose placeholders alone reach ``max_tokens`` (or the context window), or an
embedding request whose whole prompt is computed once the step in flight runs, is finished
for sure by the pending update: ``finishes_by_length`` keeps it out of the next step. Under
synchronous steps nothing here runs and every request has 0 placeholders.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenwire.runtime.core.request import Request


def advance(requests: Mapping[str, Request], num_scheduled: Mapping[str, int]) -> int:
    """Progress as if the step just scheduled had run: computed tokens move on, and a row it
    brings up to date gets one placeholder for the token it will sample. The number of rows
    that sample (placeholders added)."""
    sampling = 0
    for request_id, num_tokens in num_scheduled.items():
        request = requests[request_id]
        request.num_computed_tokens += num_tokens
        if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1
            sampling += 1
    return sampling


def settle(request: Request) -> None:
    """A token sampled under a placeholder arrived (``update`` appends it)."""
    if request.num_output_placeholders:  # 0: preempted while its step ran (reset)
        request.num_output_placeholders -= 1


def finishes_by_length(request: Request) -> bool:
    """The tokens in flight make it reach ``max_tokens`` (capped by the context window), or
    it is an embedding request whose prompt the step in flight completes (it pools instead
    of sampling): the pending update finishes it, so no later step may run it."""
    placeholders = request.num_output_placeholders
    if not placeholders:
        return False
    pooled = request.sampling_params.pooling is not None
    return pooled or request.num_output_tokens + placeholders >= request.max_tokens
