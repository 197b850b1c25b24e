"""tokenwire kernels: each op beside its torch reference."""
