"""Apply a ``GrammarBitmask`` to the logits of the constrained rows (torch, any device).

No xgrammar here, so a GPU box needs none: on CPU the bits are unpacked with numpy
(``unpackbits``, little bit order = token order) into a [rows, V] "disallowed" mask; on an
accelerator the packed words travel (V/8 bytes a row) and are unpacked there with shifts.
Disallowed logits become -inf (``masked_fill_``, which is cheap for real masks: long runs of
equal bits). Only the listed rows are touched; a batch without constrained rows never calls
this.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenwire.runtime.structured.bitmask import BITS_PER_WORD, GrammarBitmask


def disallowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 bitmask (on any device) -> [N, vocab_size] bool, True = masked."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: bit k is still bit k
    return bits.view(words.shape[0], -1)[:, :vocab_size] == 0


def _disallowed_on_host(words: np.ndarray, vocab_size: int) -> torch.Tensor:
    # Little-endian words: byte k holds tokens 8k..8k+7, lowest bit first.
    inverted = np.invert(words).astype("<i4", copy=False).view(np.uint8)
    bits = np.unpackbits(inverted, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.view(np.bool_))


def apply_grammar_bitmask(
    logits: torch.Tensor, row_of: dict[str, int], bitmask: GrammarBitmask
) -> None:
    """In place: ``logits[row_of[rid]]`` keeps only the tokens its grammar allows; the
    ``j``-th bitmask row of a request (a speculating one has several) masks logits row
    ``row_of[rid] + j``. Requests of the bitmask absent from ``row_of`` are skipped."""
    seen: dict[str, int] = {}
    picks = []
    for i, rid in enumerate(bitmask.req_ids):
        if rid in row_of:
            picks.append((i, row_of[rid] + seen.get(rid, 0)))
            seen[rid] = seen.get(rid, 0) + 1
    if not picks:
        return
    words = bitmask.to_array()
    if len(picks) != len(words):
        words = words[[i for i, _ in picks]]
    vocab = logits.shape[-1]
    if words.shape[1] * BITS_PER_WORD < vocab:
        raise ValueError(f"the bitmask covers {words.shape[1] * 32} tokens, the logits {vocab}")
    if logits.device.type == "cpu":
        masked = _disallowed_on_host(words, vocab)
    else:
        device_words = torch.from_numpy(words).to(logits.device, non_blocking=True)
        masked = disallowed_tokens(device_words, vocab)
    rows = [r for _, r in picks]
    if rows == list(range(logits.shape[0])):  # every row constrained, in order
        logits.masked_fill_(masked, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill_(masked, float("-inf"))
