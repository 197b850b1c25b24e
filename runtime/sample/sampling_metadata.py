"""Per-step sampling state of a batch of B rows, as tensors on the logits' device.

The model runner builds one ``SamplingMetadata`` per step from ``RowSamplingState`` views.
Every optional field is ``None`` when no row needs that stage, so the sampler skips it; the
common batch (all greedy, no penalties, no bias, no logprobs) costs O(B) host work and
allocates nothing of shape [B, V].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tokenwire.runtime.sample.token_masks import (
    AllowedTokens,
    BannedTokens,
    allowed_tokens,
    banned_by_bad_words,
)
from tokenwire.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class RowSamplingState:
    """What the sampler needs about one batch row this step (read-only view).

    ``generator`` is present iff ``params.seed`` is set: the runner creates it once per request
    on the logits' device (``torch.Generator(device).manual_seed(seed)``) and keeps it across
    steps, so a seeded request sees the same random stream wherever it sits in a batch.
    ``stop_token_ids_for_min_tokens`` is EOS ids ∪ stop_token_ids; those tokens are masked
    while ``len(output_token_ids) < params.min_tokens``.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    stop_token_ids_for_min_tokens: frozenset[int] = frozenset()


@dataclass(frozen=True)
class PenaltyTensors:
    """Penalty inputs; each coefficient is ``None`` when no row uses it (its stage is skipped).

    Rows that use no penalty carry neutral values (0.0, 0.0, 1.0) and empty token counts.
    """

    # [B, V] float32: occurrences of each token in the row's OUTPUT so far (exact below 2**24).
    output_token_counts: torch.Tensor
    presence: torch.Tensor | None  # [B] float32, 0.0 = off
    frequency: torch.Tensor | None  # [B] float32, 0.0 = off
    repetition: torch.Tensor | None  # [B] float32, 1.0 = off
    # [B, V] bool: token occurs in the row's prompt. Set iff ``repetition`` is.
    prompt_mask: torch.Tensor | None


@dataclass(frozen=True)
class LogitBias:
    """Sparse additive bias: ``logits[rows[i], token_ids[i]] += values[i]`` (pairs unique)."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32


@dataclass(frozen=True)
class MinTokensMask:
    """(row, token) pairs forced to -inf: stop/EOS ids of rows still under ``min_tokens``."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64


@dataclass(frozen=True)
class SamplingMetadata:
    """Batched sampling parameters of B rows (all tensors on the target device)."""

    vocab_size: int
    # [B] float32. Greedy rows hold 1.0 so the (discarded) random path stays finite for them.
    temperature: torch.Tensor
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    # Random-row filters; disabled rows hold V / 1.0 / 0.0, greedy rows count as disabled.
    top_k: torch.Tensor | None  # [B] int64 in [1, V]
    top_p: torch.Tensor | None  # [B] float32 in (0, 1]
    min_p: torch.Tensor | None  # [B] float32 in [0, 1]
    # Row index -> the request's own generator, for seeded random rows only.
    generators: Mapping[int, torch.Generator]
    penalties: PenaltyTensors | None
    logit_bias: LogitBias | None
    min_tokens_mask: MinTokensMask | None
    # Largest ``params.logprobs`` over the batch; None when no row wants logprobs.
    max_num_logprobs: int | None
    num_logprobs: tuple[int | None, ...]  # per row, ``params.logprobs``
    # Draws the noise of unseeded random rows; None falls back to torch's default generator.
    default_generator: torch.Generator | None = None
    # allowed_token_ids whitelists and bad words' banned tokens (``sample/token_masks.py``)
    allowed_tokens: AllowedTokens | None = None
    banned_tokens: BannedTokens | None = None

    @property
    def num_rows(self) -> int:
        return len(self.num_logprobs)


def build_sampling_metadata(
    rows: Sequence[RowSamplingState],
    vocab_size: int,
    device: torch.device,
    default_generator: torch.Generator | None = None,
) -> SamplingMetadata:
    """Batch the rows' sampling state into tensors on ``device`` (row order is kept)."""
    if all(r.params.is_plain_greedy for r in rows):  # the common case: O(B), tiny tensors
        num = len(rows)
        return SamplingMetadata(
            vocab_size=vocab_size,
            temperature=torch.ones(num, dtype=torch.float32, device=device),
            is_greedy=torch.ones(num, dtype=torch.bool, device=device),
            all_greedy=True,
            all_random=False,
            top_k=None,
            top_p=None,
            min_p=None,
            generators={},
            penalties=None,
            logit_bias=None,
            min_tokens_mask=None,
            max_num_logprobs=None,
            num_logprobs=(None,) * num,
            default_generator=default_generator,
        )
    _check_generators(rows)
    params = [r.params for r in rows]
    greedy = [p.greedy for p in params]
    all_greedy = all(greedy)
    num_logprobs = tuple(p.logprobs for p in params)
    requested = [n for n in num_logprobs if n is not None]
    return SamplingMetadata(
        vocab_size=vocab_size,
        temperature=_floats([1.0 if p.greedy else p.temperature for p in params], device),
        is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        all_greedy=all_greedy,
        all_random=bool(rows) and not any(greedy),
        top_k=None if all_greedy else _top_k(params, vocab_size, device),
        top_p=None if all_greedy else _top_p(params, device),
        min_p=None if all_greedy else _min_p(params, device),
        generators={
            i: r.generator
            for i, r in enumerate(rows)
            if r.generator is not None and not r.params.greedy
        },
        penalties=_penalties(rows, vocab_size, device),
        logit_bias=_logit_bias(params, device),
        min_tokens_mask=_min_tokens_mask(rows, device),
        max_num_logprobs=max(requested) if requested else None,
        num_logprobs=num_logprobs,
        default_generator=default_generator,
        allowed_tokens=allowed_tokens(params, vocab_size, device),
        banned_tokens=banned_by_bad_words(
            [p.bad_words_token_ids for p in params], [r.output_token_ids for r in rows], device
        ),
    )


def _check_generators(rows: Sequence[RowSamplingState]) -> None:
    for i, r in enumerate(rows):
        if (r.generator is None) != (r.params.seed is None):
            raise ValueError(
                f"row {i}: generator must be given iff params.seed is set "
                f"(seed={r.params.seed}, generator={'set' if r.generator else 'None'})"
            )


def _floats(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _longs(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _top_k(
    params: Sequence[SamplingParams], vocab: int, device: torch.device
) -> torch.Tensor | None:
    # top_k == 0 (disabled) or >= V keeps the whole vocabulary: stored as V.
    ks = [vocab if p.greedy or p.top_k <= 0 else min(p.top_k, vocab) for p in params]
    return _longs(ks, device) if any(k < vocab for k in ks) else None


def _top_p(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor | None:
    ps = [1.0 if p.greedy else p.top_p for p in params]
    return _floats(ps, device) if any(p < 1.0 for p in ps) else None


def _min_p(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor | None:
    ps = [0.0 if p.greedy else p.min_p for p in params]
    return _floats(ps, device) if any(p > 0.0 for p in ps) else None


def token_counts(
    seqs: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[B, V] float32 occurrence counts of each row's token ids (scatter_add, no row loop)."""
    width = max((len(s) for s in seqs), default=0)
    # Column V is a sink for the padding; it is sliced away below.
    counts = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.float32, device=device)
    if width > 0:
        padded = [[*s, *([vocab_size] * (width - len(s)))] for s in seqs]
        ids = torch.tensor(padded, dtype=torch.int64, device=device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def _penalties(
    rows: Sequence[RowSamplingState], vocab: int, device: torch.device
) -> PenaltyTensors | None:
    params = [r.params for r in rows]
    if not any(p.needs_penalties for p in params):
        return None
    # Rows without penalties contribute no tokens: their neutral coefficients ignore counts.
    outputs = [r.output_token_ids if r.params.needs_penalties else () for r in rows]
    presence = [p.presence_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    repetition = [p.repetition_penalty for p in params]
    use_repetition = any(x != 1.0 for x in repetition)
    prompt_mask = None
    if use_repetition:
        prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in rows]
        prompt_mask = token_counts(prompts, vocab, device) > 0
    return PenaltyTensors(
        output_token_counts=token_counts(outputs, vocab, device),
        presence=_floats(presence, device) if any(presence) else None,
        frequency=_floats(frequency, device) if any(frequency) else None,
        repetition=_floats(repetition, device) if use_repetition else None,
        prompt_mask=prompt_mask,
    )


def _logit_bias(params: Sequence[SamplingParams], device: torch.device) -> LogitBias | None:
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(i)
            tokens.append(token)
            values.append(bias)
    if not rows:
        return None
    return LogitBias(_longs(rows, device), _longs(tokens, device), _floats(values, device))


def _min_tokens_mask(
    rows: Sequence[RowSamplingState], device: torch.device
) -> MinTokensMask | None:
    row_ids: list[int] = []
    tokens: list[int] = []
    for i, r in enumerate(rows):
        # A constrained row's grammar decides where EOS may come (see SamplingParams).
        if r.params.structured_outputs is not None:
            continue
        if len(r.output_token_ids) < r.params.min_tokens:
            # Sorted so the tensors (and anything derived) do not depend on set order.
            for token in sorted(r.stop_token_ids_for_min_tokens):
                row_ids.append(i)
                tokens.append(token)
    if not row_ids:
        return None
    return MinTokensMask(_longs(row_ids, device), _longs(tokens, device))
