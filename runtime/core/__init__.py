"""The engine core's bookkeeping: torch-free, runs in the engine-core process.

The scheduler and its step builder, the request state and waiting queues, token-level stop
checks, the KV cache manager over the block pool (prefix caching), and the scheduler's half of
speculative decoding (``spec/``). Nothing here imports torch, ``tokenwire.kernels`` or the
worker (``tests/project/test_layering.py`` checks it).
"""
