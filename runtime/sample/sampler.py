"""Batched sampler: logits [B, V] -> one token per row (+ raw logprobs), on the logits' device.

Order of processing (vLLM v1):
  1. logprobs, when any row wants them: log_softmax of the RAW logits (what is reported);
  2. token masks (allowed_token_ids, bad_words); logit bias; 3. min_tokens mask;
  4. penalties (repetition, then frequency and presence);
  5. greedy rows: argmax of the processed logits (first max on ties, as HF ``generate``);
  6. random rows: temperature, min_p, top-k, top-p, then the exponential race
     ``argmax(probs / q)`` with ``q ~ Exponential(1)``, which samples from ``probs``.
A stage no row needs is skipped. There are no host syncs and no per-row Python loops, except
one ``exponential_`` draw of V values per seeded row per step with that request's generator:
this makes a seeded row's tokens independent of batch size and row position. The input
logits are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenwire.runtime.model_output import TokenLogprobs
from tokenwire.runtime.sample.sampling_metadata import PenaltyTensors, SamplingMetadata
from tokenwire.runtime.sample.token_masks import apply_token_masks_

_NEG_INF = float("-inf")
# Lower bound on the exponential noise: a zero draw would turn probs / q into inf or nan.
_MIN_NOISE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class LogprobsTensors:
    """Raw-distribution logprobs; column 0 is the sampled token, then the top-K in order."""

    token_ids: torch.Tensor  # [B, 1 + K] int64
    logprobs: torch.Tensor  # [B, 1 + K] float32
    ranks: torch.Tensor  # [B] int64, 1-based rank of the sampled token (ties count against it)

    def rows(self, ks: list[int | None]) -> list[TokenLogprobs | None]:
        """Per row, the chosen token and its top ``ks[i]`` alternatives (None: not asked)."""
        ids = self.token_ids.tolist()
        lps = self.logprobs.tolist()
        ranks = self.ranks.tolist()
        return [
            None if k is None else TokenLogprobs(ids[i][: k + 1], lps[i][: k + 1], ranks[i])
            for i, k in enumerate(ks)
        ]


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no row asked; K = meta.max_num_logprobs


class Sampler:
    """Stateless; all per-request state arrives in ``SamplingMetadata``."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits must be [B={meta.num_rows}, V], got {tuple(logits.shape)}")
        logits = logits.float()  # no copy when already float32
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = apply_logits_processors(logits, meta)
        sampled = _sample(processed, meta)
        if raw_logprobs is None or meta.max_num_logprobs is None:
            return SamplerOutput(sampled, None)
        return SamplerOutput(sampled, gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs))


def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.all_greedy:
        return logits.argmax(dim=-1)
    random = sample_random(logits, meta)
    if meta.all_random:
        return random
    return torch.where(meta.is_greedy, logits.argmax(dim=-1), random)


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Token masks, logit bias, min_tokens mask, penalties. Returns ``logits`` itself when
    none applies, otherwise a new tensor (the input is never written)."""
    masks = meta.allowed_tokens is not None or meta.banned_tokens is not None
    if (
        meta.logit_bias is None
        and meta.min_tokens_mask is None
        and meta.penalties is None
        and not masks
    ):
        return logits
    out = logits.clone()
    if masks:
        apply_token_masks_(out, meta.allowed_tokens, meta.banned_tokens)
    if meta.logit_bias is not None:
        bias = meta.logit_bias
        out.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if meta.min_tokens_mask is not None:
        mask = meta.min_tokens_mask
        out[mask.rows, mask.token_ids] = _NEG_INF
    if meta.penalties is not None:
        out = apply_penalties(out, meta.penalties)
    return out


def apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> torch.Tensor:
    """vLLM semantics, in place where possible; returns the penalised logits.

    Repetition (HF): for tokens in the prompt or the output, logit > 0 -> logit / r, else
    logit * r. Then frequency ``-= f * count`` and presence ``-= p * (count > 0)`` over the
    OUTPUT tokens only (OpenAI definition). Neutral rows (r = 1, f = p = 0) are unchanged
    bit for bit.
    """
    counts = pen.output_token_counts
    if pen.repetition is not None and pen.prompt_mask is not None:
        r = pen.repetition.unsqueeze(1)
        seen = pen.prompt_mask | (counts > 0)
        scaled = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(seen, scaled, logits)
    if pen.frequency is not None:
        logits.sub_(pen.frequency.unsqueeze(1) * counts)
    if pen.presence is not None:
        logits.sub_(pen.presence.unsqueeze(1) * (counts > 0))
    return logits


def sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, min_p, top-k, top-p, then the exponential race; [B] int64 token ids."""
    probs = random_probs(logits, meta)
    noise = exponential_noise(probs, meta)
    return probs.div_(noise).argmax(dim=-1)


def random_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[B, V] the distribution random rows sample from: temperature, min_p, top-k, top-p."""
    scaled = logits / meta.temperature.unsqueeze(1)  # new tensor: in-place edits below are safe
    if meta.min_p is not None:
        apply_min_p_(scaled, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        scaled = apply_top_k_top_p(scaled, meta.top_k, meta.top_p)
    return scaled.softmax(dim=-1)


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: drop tokens with prob < min_p * max_prob (the top token always survives)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's top-k tokens (ties with the k-th kept), then the smallest top set whose
    probability reaches top_p (the top token always kept). Kept logits are unchanged; the rest
    become -inf. Rows with k = V and p = 1 come back bit-identical."""
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1)  # ascending: the top token is the last column
    if top_k is not None:
        kth_largest = ordered.gather(1, (vocab - top_k).unsqueeze(1))
        ordered.masked_fill_(ordered < kth_largest, _NEG_INF)
    if top_p is not None:
        cumulative = ordered.softmax(dim=-1).cumsum_(dim=-1)
        # Drop the low tail whose mass is <= 1 - p, so what is kept has mass >= p. Rows with
        # p = 1 get limit -1: nothing dropped, not even zero-probability tokens.
        limit = torch.where(top_p < 1.0, 1.0 - top_p, -1.0).unsqueeze(1)
        drop = cumulative <= limit
        drop[:, -1] = False
        ordered.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, ordered)


def exponential_noise(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[B, V] Exponential(1) draws: one batched draw from the engine's generator for unseeded
    rows, then one V-value draw per seeded row from that request's own generator."""
    noise = torch.empty_like(probs)
    if len(meta.generators) < probs.shape[0]:
        noise.exponential_(generator=meta.default_generator)
    for row, generator in meta.generators.items():
        noise[row].exponential_(generator=generator)
    return noise.clamp_min_(_MIN_NOISE)


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
    """The sampled token's raw logprob and rank, plus the top-``k`` alternatives."""
    sampled_col = sampled.unsqueeze(1)
    sampled_lp = raw_logprobs.gather(1, sampled_col)
    # vLLM's rank: how many tokens are at least as likely as the sampled one.
    ranks = (raw_logprobs >= sampled_lp).sum(dim=-1)
    k = min(k, raw_logprobs.shape[-1])
    if k == 0:
        return LogprobsTensors(sampled_col, sampled_lp, ranks)
    top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([sampled_col, top_ids], dim=1),
        logprobs=torch.cat([sampled_lp, top_lp], dim=1),
        ranks=ranks,
    )
