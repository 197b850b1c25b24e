"""The scheduler's half of speculative decoding (no torch): n-gram drafts, draft-model slots,
acceptance bookkeeping and drafts cut to a grammar. The runner's half is ``worker/spec/``."""
