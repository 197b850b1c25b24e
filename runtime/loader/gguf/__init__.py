"""GGUF checkpoints read with their Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K tensors kept quantized.

``reader.iter_gguf_weights`` yields HF parameter names with either a plain float tensor or a
``GGUFInt4`` / ``GGUFInt8`` record in the canonical int4 / int8 weight-only layouts.
"""

from tokenwire.runtime.loader.gguf.reader import GGUFWeight, iter_gguf_weights
from tokenwire.runtime.loader.gguf.records import GGUFInt4, GGUFInt8

__all__ = ["GGUFInt4", "GGUFInt8", "GGUFWeight", "iter_gguf_weights"]
