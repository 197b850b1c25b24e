"""What runs on the device, in a worker (the engine core's process, or one process per
tensor-parallel rank): the ``Worker`` and its process, the model runner with its settings
(``runner_settings``) and per-request state (``request_state``), input batch, KV cache
tensors and sizing, the CUDA graph runner and host staging, attention inputs off the CUDA
path, CPU tuning, row sampling, prompt logprobs, the grammar-mask apply and the runner's half
of speculative decoding (``spec/``). Calls go downward: nothing here imports the model runner
but the worker. Imports torch; never the scheduler (``runtime/core/``)."""
