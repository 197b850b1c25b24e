"""The model runner's side of a speculative step.

Before the forward, each drafted row gets its drafts written after its known tokens in the
``InputBatch`` (``write_drafts``; the step's inputs are ``[last token, d_1 .. d_k]``); its
``k + 1`` query positions are scored in the same forward. After it, ``plan_verify`` says which
hidden states to score (the runner computes their logits), and ``verify_rows`` samples the
rows without drafts (``sample_rows``) and verifies the drafted ones (``sample/rejection``);
every emitted token is appended to the row, and the row's computed count steps back over its
rejected drafts (their KV slots are rewritten by the next step). Every input is explicit:
the batch, the ``RowSampler``, the logits, the request states; never the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenwire.runtime.model_output import TokenLogprobs
from tokenwire.runtime.sample.rejection import verify_drafts
from tokenwire.runtime.sample.sampler import gather_logprobs
from tokenwire.runtime.structured.bitmask import GrammarBitmask
from tokenwire.runtime.worker.grammar_mask import apply_grammar_bitmask
from tokenwire.runtime.worker.input_batch import InputBatch, StepArrays
from tokenwire.runtime.worker.request_state import CachedRequestState
from tokenwire.runtime.worker.sample_rows import RowSampler, StepTokens, sample_rows


def write_drafts(
    batch: InputBatch, states: list[CachedRequestState], drafts: dict[str, list[int]]
) -> None:
    for state in states:
        draft = drafts.get(state.request_id)
        if draft and state.row is not None:
            start = int(batch.num_tokens[state.row])
            batch.token_ids[state.row, start : start + len(draft)] = draft


@dataclass(frozen=True)
class VerifyPlan:
    """The rows of a verify step that sample or verify, and the hidden states they score."""

    idx: np.ndarray  # their indices among the step's rows (batch order)
    counts: np.ndarray  # positions each scores: 1 + its drafts
    positions: np.ndarray  # the hidden-state rows to score, row after row


def plan_verify(
    batch: InputBatch,
    drafts: dict[str, list[int]],
    states: list[CachedRequestState],
    rows: np.ndarray,
    arrays: StepArrays,
) -> VerifyPlan:
    """``drafts``: the scheduler's n-gram drafts, or the worker's draft-model proposals."""
    # A row samples when this step brings it up to date; a drafted row runs past it.
    idx = np.flatnonzero(arrays.seq_lens >= batch.num_tokens[rows])
    counts = np.array([1 + len(drafts.get(states[i].request_id, ())) for i in idx], np.int64)
    ends = arrays.query_start_loc[1:][idx].astype(np.int64)
    starts = np.repeat(ends - counts, counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return VerifyPlan(idx, counts, starts + offsets)


def verify_rows(
    sampling: RowSampler,
    batch: InputBatch,
    plan: VerifyPlan,
    logits: torch.Tensor,
    states: list[CachedRequestState],
    rows: np.ndarray,
    drafts: dict[str, list[int]],
    bitmask: GrammarBitmask | None,
) -> StepTokens:
    """Sample the planned rows without drafts, verify the drafted ones; ``logits``: the
    scores of ``plan.positions``."""
    idx, counts = plan.idx, plan.counts
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    plain = [j for j, c in enumerate(counts) if c == 1]
    spec = [j for j, c in enumerate(counts) if c > 1]
    out = sample_rows(
        sampling,
        batch,
        logits[torch.from_numpy(first[plain])],
        [states[idx[j]] for j in plain],
        rows[idx[plain]],
        bitmask,
    )
    if not spec:
        return out
    pos = np.concatenate([np.arange(first[j], first[j] + counts[j]) for j in spec])
    spec_states = [states[idx[j]] for j in spec]
    spec_logits = logits[torch.from_numpy(pos)]
    starts = np.cumsum([0] + [int(counts[j]) for j in spec])[:-1]
    if bitmask is not None:  # constrained rows: one mask row per position
        row_of = {s.request_id: int(o) for s, o in zip(spec_states, starts, strict=True)}
        apply_grammar_bitmask(spec_logits, row_of, bitmask)
    emitted = verify_drafts(
        spec_logits,
        [s.sampling for s in spec_states],
        [drafts[s.request_id] for s in spec_states],
        sampling.vocab_size,
        sampling.generator,
    )
    run_lps = run_logprobs(spec_logits, starts, spec_states, emitted)
    for state, row, run in zip(spec_states, rows[idx[spec]], emitted, strict=True):
        _append_run(batch, state, int(row), run, len(drafts[state.request_id]))
        _report_run(out, state.request_id, run, run_lps.get(state.request_id))
    return out


def _report_run(
    out: StepTokens, request_id: str, run: list[int], lps: list[TokenLogprobs] | None
) -> None:
    out.req_ids.append(request_id)
    out.token_ids.append(run[0])
    if len(run) > 1:
        out.extra_token_ids[request_id] = run[1:]
    if lps is not None:
        out.logprobs[request_id], *rest = lps
        if rest:
            out.extra_logprobs[request_id] = rest


def run_logprobs(
    logits: torch.Tensor,
    starts: np.ndarray,
    states: list[CachedRequestState],
    emitted: list[list[int]],
) -> dict[str, list[TokenLogprobs]]:
    """Logprobs of every token a verified row emitted, for the rows that asked: token ``j``
    of a run from position ``j`` of the row's scores (``logits`` rows ``starts[i] + j``),
    log-softmax of those logits as the plain sampler reports (after a grammar mask)."""
    want = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not want:
        return {}
    positions = [int(starts[i]) + j for i in want for j in range(len(emitted[i]))]
    chosen = [t for i in want for t in emitted[i]]
    k = max(int(states[i].params.logprobs or 0) for i in want)
    raw = torch.log_softmax(logits[torch.tensor(positions, device=logits.device)].float(), dim=-1)
    sampled = torch.tensor(chosen, dtype=torch.int64, device=logits.device)
    lp = gather_logprobs(raw, sampled, k)
    entries = lp.rows([states[i].params.logprobs for i in want for _ in emitted[i]])
    out: dict[str, list[TokenLogprobs]] = {}
    at = 0
    for i in want:
        n = len(emitted[i])
        out[states[i].request_id] = [e for e in entries[at : at + n] if e is not None]
        at += n
    return out


def _append_run(
    batch: InputBatch, state: CachedRequestState, row: int, tokens: list[int], num_drafts: int
) -> None:
    start = int(batch.num_tokens[row])
    batch.token_ids[row, start : start + len(tokens)] = tokens
    batch.num_tokens[row] = start + len(tokens)
    batch.num_computed[row] -= num_drafts - (len(tokens) - 1)  # rejected drafts
    state.output_token_ids.extend(tokens)
