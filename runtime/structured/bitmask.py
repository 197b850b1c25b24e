"""``GrammarBitmask``: the allowed-token bitmask of one step's constrained rows (plain data).

The scheduler fills it (no torch: a numpy int32 array, xgrammar's layout: bit ``t % 32`` of
word ``t // 32`` set = token ``t`` allowed) and it crosses to the executor inside
``SchedulerOutput`` as bytes, so it survives the msgspec hop to tensor-parallel workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BITS_PER_WORD = 32


def num_words(vocab_size: int) -> int:
    return -(-vocab_size // BITS_PER_WORD)


@dataclass(frozen=True, slots=True)
class GrammarBitmask:
    """Row ``i`` (``words`` little-endian int32) belongs to request ``req_ids[i]``; a
    speculating request has consecutive rows, one per scored position, in order."""

    req_ids: list[str]
    words: int
    data: bytes

    @classmethod
    def from_array(cls, req_ids: list[str], array: np.ndarray) -> GrammarBitmask:
        assert array.dtype == np.int32 and array.shape == (len(req_ids), array.shape[1])
        return cls(req_ids, int(array.shape[1]), array.astype("<i4", copy=False).tobytes())

    def to_array(self) -> np.ndarray:
        """A writable [rows, words] int32 copy."""
        flat = np.frombuffer(self.data, dtype="<i4").astype(np.int32)
        return flat.reshape(len(self.req_ids), self.words)
