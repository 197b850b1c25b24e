"""Token-level stop rules of a request after it sampled a token (no torch, no text: stop
strings are the front's detokenizer's business)."""

from __future__ import annotations

import logging

from tokenwire.runtime.core.request import Request
from tokenwire.runtime.outputs import FinishReason

logger = logging.getLogger("tokenwire.engine")


def token_stop(
    request: Request, token: int, max_model_len: int
) -> tuple[FinishReason, int | str | None] | None:
    """(finish reason, stop reason) if ``token`` ends ``request``, else None."""
    num_output = request.num_output_tokens
    reason: FinishReason | None = None
    stop_reason: int | str | None = None
    grammar = request.grammar
    if grammar is not None and grammar.rejected:  # the mask allowed it: never expected
        logger.error("request %s: its grammar rejected token %d", request.request_id, token)
        reason = FinishReason.ERROR
    elif grammar is not None and grammar.terminated:  # complete: min_tokens cannot hold it
        if token in request.eos_token_ids:
            reason = FinishReason.EOS
        elif token in request.stop_token_ids:
            reason, stop_reason = FinishReason.STOP_TOKEN, token
        else:  # no stop token to take (the matcher terminates without one): content
            reason = FinishReason.GRAMMAR_END
    elif num_output >= request.sampling_params.min_tokens:
        if token in request.eos_token_ids:
            reason = FinishReason.EOS
        elif token in request.stop_token_ids:
            reason, stop_reason = FinishReason.STOP_TOKEN, token
    if reason is None and num_output >= request.max_tokens:
        user_max = request.sampling_params.max_tokens
        capped = user_max is None or user_max > request.max_tokens
        reason = FinishReason.CONTEXT_LENGTH if capped else FinishReason.LENGTH
    if reason is None and request.num_tokens >= max_model_len:
        reason = FinishReason.CONTEXT_LENGTH
    if reason is None:
        return None
    return reason, stop_reason
