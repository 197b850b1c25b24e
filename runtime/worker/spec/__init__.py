"""The runner's half of speculative decoding: the verify step (drafts written into the batch,
scored, accepted) and the draft model with its own paged KV cache. The scheduler's half is
``core/spec/``; rejection sampling is ``sample/rejection``."""
