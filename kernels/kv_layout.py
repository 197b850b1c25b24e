"""The paged KV layout's one shared constant: the null block.

Block ``NULL_BLOCK_ID`` is never allocated to a request (``runtime/block_pool.py``), so block
tables are padded with it and the kernels may read it harmlessly: masked positions and padded
block-table entries point at it, and ``store_kv`` never writes it (padding rows carry slot -1).
Defined here, beside the kernels that rely on it, because the runtime imports the kernels and
never the other way round. No imports: the scheduler side (no torch) uses it too.
"""

from __future__ import annotations

NULL_BLOCK_ID = 0
