"""The model runner's side of a speculative step.

Before the forward, each drafted row gets its drafts written after its known tokens in the
``InputBatch`` (so the step's inputs are ``[last token, d_1 .. d_k]``); its ``k + 1`` query
positions are scored in the same forward. After it, rows without drafts sample as usual and
drafted rows are verified (``verify.verify_drafts``); every emitted token is appended to the
row, and the row's computed count steps back over its rejected drafts (their KV slots are
rewritten by the next step).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenwire.runtime.model_output import ModelOutput, TokenLogprobs
from tokenwire.runtime.sample.rejection import verify_drafts
from tokenwire.runtime.sample.sampler import gather_logprobs
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.worker.grammar_mask import apply_grammar_bitmask
from tokenwire.runtime.worker.input_batch import InputBatch, StepArrays

if TYPE_CHECKING:
    from tokenwire.runtime.worker.model_runner import CachedRequestState, ModelRunner


def write_drafts(
    batch: InputBatch, states: list[CachedRequestState], drafts: dict[str, list[int]]
) -> None:
    for state in states:
        draft = drafts.get(state.request_id)
        if draft and state.row is not None:
            start = int(batch.num_tokens[state.row])
            batch.token_ids[state.row, start : start + len(draft)] = draft


def spec_step(
    runner: ModelRunner,
    so: SchedulerOutput,
    drafts: dict[str, list[int]],
    states: list[CachedRequestState],
    rows: np.ndarray,
    arrays: StepArrays,
    hidden: torch.Tensor,
    times: tuple[float, float, float],
) -> ModelOutput:
    """Sample the rows without drafts, verify the drafted ones (``drafts``: the scheduler's
    n-gram drafts, or the worker's draft-model proposals); ``times`` = (step start, forward
    start, collective clock at the start)."""
    t0, t1, collective0 = times
    batch = runner.batch
    # A row samples when this step brings it up to date; a drafted row runs past it.
    idx = np.flatnonzero(arrays.seq_lens >= batch.num_tokens[rows])
    counts = np.array([1 + len(drafts.get(states[i].request_id, ())) for i in idx], np.int64)
    ends = arrays.query_start_loc[1:][idx].astype(np.int64)
    starts = np.repeat(ends - counts, counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    logits = runner.model.compute_logits(hidden[torch.from_numpy(starts + offsets)])
    t2 = time.perf_counter()
    prompt_lps = runner.prompt_logprobs(states, arrays, hidden)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    plain = [j for j, c in enumerate(counts) if c == 1]
    spec = [j for j, c in enumerate(counts) if c > 1]
    req_ids, tokens, logprobs = runner.sample(
        logits[torch.from_numpy(first[plain])],
        [states[idx[j]] for j in plain],
        rows[idx[plain]],
        so.grammar_bitmask,
    )
    extra: dict[str, list[int]] = {}
    extra_lps: dict[str, list[TokenLogprobs]] = {}
    if spec:
        pos = np.concatenate([np.arange(first[j], first[j] + counts[j]) for j in spec])
        spec_states = [states[idx[j]] for j in spec]
        spec_logits = logits[torch.from_numpy(pos)]
        starts = np.cumsum([0] + [int(counts[j]) for j in spec])[:-1]
        if so.grammar_bitmask is not None:  # constrained rows: one mask row per position
            row_of = {s.request_id: int(o) for s, o in zip(spec_states, starts, strict=True)}
            apply_grammar_bitmask(spec_logits, row_of, so.grammar_bitmask)
        emitted = verify_drafts(
            spec_logits,
            [s.sampling for s in spec_states],
            [drafts[s.request_id] for s in spec_states],
            runner.vocab_size,
            runner.generator,
        )
        run_lps = run_logprobs(spec_logits, starts, spec_states, emitted)
        for state, row, out in zip(spec_states, rows[idx[spec]], emitted, strict=True):
            _append_run(batch, state, int(row), out, len(drafts[state.request_id]))
            req_ids.append(state.request_id)
            tokens.append(out[0])
            if len(out) > 1:
                extra[state.request_id] = out[1:]
            if state.request_id in run_lps:
                logprobs[state.request_id], *rest = run_lps[state.request_id]
                if rest:
                    extra_lps[state.request_id] = rest
    t3 = time.perf_counter()
    return ModelOutput(
        req_ids=req_ids,
        sampled_token_ids=tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_lps,
        prepare_time=t1 - t0,
        forward_time=t2 - t1,
        sample_time=t3 - t2,
        collective_time=runner.tp.clock.seconds - collective0,
        extra_token_ids=extra,
        extra_logprobs=extra_lps,
    )


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
