"""What the runtime needs to know about a model's sliding-window layers.

The attention plans need the distinct windows (one gather plan per window per step); the KV
cache manager needs the window that bounds every layer, if there is one (only then can a
block fall out of every layer's view and be freed).
"""

from __future__ import annotations

from tokenwire.runtime.models.arch import ModelArch


def distinct_windows(arch: ModelArch) -> tuple[int, ...]:
    """The sorted distinct attention windows of the model's windowed layers."""
    windows = (arch.layer_window(i) for i in range(arch.num_hidden_layers))
    return tuple(sorted({w for w in windows if w is not None}))


def distinct_chunks(arch: ModelArch) -> tuple[int, ...]:
    """The sorted distinct attention chunk sizes of the model's chunked layers (Llama 4).
    Chunked layers keep every KV block (``every_layer_window`` counts them as full)."""
    chunks = (arch.layer_chunk(i) for i in range(arch.num_hidden_layers))
    return tuple(sorted({c for c in chunks if c is not None}))


def every_layer_window(arch: ModelArch) -> int | None:
    """The largest window when every layer has one; None when any layer attends to the whole
    context (then no KV block ever falls out of every layer's window)."""
    windows = [arch.layer_window(i) for i in range(arch.num_hidden_layers)]
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)
