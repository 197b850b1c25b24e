"""Speculative decoding: ``ngram`` proposes draft tokens on the scheduler side (no torch);
``verify`` checks them against the target model's distribution in the runner (greedy
equality, rejection sampling for sampled rows)."""
