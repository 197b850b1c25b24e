"""What runs on the device, in a worker (the engine core's process, or one process per
tensor-parallel rank): the ``Worker`` and its process, the model runner, input batch, KV cache
tensors and sizing, the CUDA graph runner and host staging, CPU tuning, prompt logprobs, the
grammar-mask apply and the runner's half of speculative decoding (``spec/``). Imports torch;
never the scheduler (``runtime/core/``)."""
