"""Sampling on the logits' device: the batched sampler, its per-step metadata, and exact
rejection sampling of speculative drafts. Runs in the worker; takes tensors, not the runner."""
