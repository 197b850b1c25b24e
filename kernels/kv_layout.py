"""The paged KV layout's one shared constant: the null block.

Block ``NULL_BLOCK_ID`` is never allocated to a request (``runtime/core/block_pool.py``), so block
tables are padded with it and the kernels may read it harmlessly: masked positions and padded
block-table entries point at it, and ``store_kv`` never writes it (padding rows carry slot -1).
The runtime's scheduler side (no torch, no kernels) defines the same id in
``runtime/scheduler_output.py``; ``tests/project/test_layering.py`` checks that the two agree.
"""

from __future__ import annotations

NULL_BLOCK_ID = 0
