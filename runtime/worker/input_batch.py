"""Persistent per-row host buffers for building a step's inputs without per-token Python loops.

Each active request owns one row of ``token_ids`` ([max_num_seqs, max_model_len] int32) and of
``block_table`` ([max_num_seqs, max_blocks_per_seq] int32, padded with the null block). Rows
are reused: a finished or preempted request returns its row to the free list. Step inputs
(positions, slot_mapping, gathered token ids, block tables) come from vectorised numpy
indexing over these rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenwire.runtime.scheduler_output import NULL_BLOCK_ID


@dataclass(frozen=True, slots=True)
class StepArrays:
    """Host-side inputs of one forward, rows in batch order (decode rows first)."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int32 [B+1]
    seq_lens: np.ndarray  # int32 [B]
    block_tables: np.ndarray  # int32 [B, max_blocks_in_batch]
    num_decodes: int
    max_query_len: int
    max_seq_len: int


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        self.block_table = np.full(
            (max_num_seqs, self.max_blocks_per_seq), NULL_BLOCK_ID, dtype=np.int32
        )
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_computed = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)  # prompt + output tokens known
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    # ------------------------------------------------------------------ row lifecycle
    def add_row(self, token_ids: list[int], block_ids: list[int], num_computed: int) -> int:
        if not self._free_rows:
            raise RuntimeError("input batch is full: more active requests than max_num_seqs")
        row = self._free_rows.pop()
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_blocks[row] = 0
        self.block_table[row] = NULL_BLOCK_ID  # a reused row keeps no stale block ids
        self.append_blocks(row, block_ids)
        self.num_computed[row] = num_computed
        self.num_tokens[row] = len(token_ids)
        return row

    def release_row(self, row: int) -> None:
        self._free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, rows: np.ndarray, token_ids: list[int]) -> None:
        """Append one sampled token to each of ``rows`` (vectorised)."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    # ------------------------------------------------------------------ step inputs
    def build(self, rows: np.ndarray, query_lens: np.ndarray, num_decodes: int) -> StepArrays:
        """Vectorised gather of one step's inputs; ``rows``/``query_lens`` in batch order."""
        bs = self.block_size
        starts = self.num_computed[rows]  # tokens already in the KV cache, per sequence
        cu = np.cumsum(query_lens)
        num_tokens = int(cu[-1])
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        query_start_loc[1:] = cu
        if num_tokens == len(rows):  # pure decode: one token per sequence
            seq_of_token = np.arange(len(rows))
            positions = starts.copy()
        else:
            seq_of_token = np.repeat(np.arange(len(rows)), query_lens)
            offsets = np.arange(num_tokens) - query_start_loc[:-1].astype(np.int64)[seq_of_token]
            positions = starts[seq_of_token] + offsets
        token_rows = rows[seq_of_token]
        input_ids = self.token_ids[token_rows, positions].astype(np.int64)
        slot_mapping = self.block_table[token_rows, positions // bs].astype(np.int64) * bs
        slot_mapping += positions % bs
        seq_lens = (starts + query_lens).astype(np.int32)
        max_seq_len = int(seq_lens.max())
        max_blocks = -(-max_seq_len // bs)
        return StepArrays(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=self.block_table[rows, :max_blocks],
            num_decodes=num_decodes,
            max_query_len=int(query_lens.max()),
            max_seq_len=max_seq_len,
        )
