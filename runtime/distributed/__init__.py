"""Tensor parallelism on torch.distributed: the process group one engine's ranks share."""
