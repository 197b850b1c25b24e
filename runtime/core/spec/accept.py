"""The scheduler's side of a verified speculative step (no torch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenwire.runtime.core.request import Request
from tokenwire.runtime.outputs import EngineCoreOutput


def accept_drafts(
    request: Request,
    output: EngineCoreOutput,
    draft: list[int],
    extra: list[int],
    check_stop: Callable[[Request, int], bool],
) -> bool:
    """Append the tokens a speculative step emitted after its first (``extra``), stopping at
    the first that ends the request. The rejected drafts' KV is not valid:
    ``num_computed_tokens`` steps back over them (their slots are rewritten next step).
    True if the request finished."""
    request.num_computed_tokens -= len(draft) - len(extra)
    request.num_draft_tokens += len(draft)
    request.num_accepted_tokens += len(extra)
    for token in extra:
        request.token_ids.append(token)
        output.new_token_ids.append(token)
        if check_stop(request, token):
            output.finish_reason = request.finish_reason
            output.stop_reason = request.stop_reason
            return True
    return False


def spec_step_stats(drafts: dict[str, list[int]], extra: dict[str, list[int]]) -> dict[str, Any]:
    """``StepStats`` fields of a step's drafts: counts and per-position acceptance."""
    if not drafts:
        return {}
    width = max(len(d) for d in drafts.values())
    drafted, accepted = [0] * width, [0] * width
    num_accepted = 0
    for request_id, draft in drafts.items():
        a = len(extra.get(request_id, ()))
        num_accepted += a
        for j in range(len(draft)):
            drafted[j] += 1
            accepted[j] += j < a
    return {
        "num_drafts": len(drafts),
        "num_draft_tokens": sum(len(d) for d in drafts.values()),
        "num_accepted_tokens": num_accepted,
        "drafted_per_pos": tuple(drafted),
        "accepted_per_pos": tuple(accepted),
    }
