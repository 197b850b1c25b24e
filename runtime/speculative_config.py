"""``SpeculativeConfig``: ``--speculative-config``, n-gram or draft-model proposals (frozen,
validated like every section of ``config.EngineConfig``, which re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.runtime.config_checks import whole_count


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` (vLLM's JSON keys). ``ngram``: prompt lookup — the longest
    suffix of ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens that occurred earlier in
    the sequence proposes the ``num_speculative_tokens`` tokens that followed it.
    ``draft_model``: ``model`` (a small model with the target's vocabulary, loaded like the
    target: a local folder or hub id, same dtype and device) proposes them greedily.
    ``disable_by_batch_size``: steps with at least this many running requests decode plainly."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        # The values come from JSON: check types too (a bool is no count, 2.5 no token).
        if not isinstance(self.method, str) or self.method not in ("ngram", "draft_model"):
            raise ValueError(
                f"speculative_config method must be 'ngram' or 'draft_model', got {self.method!r}"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(
                f"speculative_config model must be a path or hub id (a string), got {self.model!r}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs 'model' (a path)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config 'model' is only for method 'draft_model'")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            whole_count(f"speculative_config {name}", getattr(self, name))
        if self.disable_by_batch_size is not None:
            whole_count("speculative_config disable_by_batch_size", self.disable_by_batch_size)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative_config prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                f"prompt_lookup_min ({self.prompt_lookup_min})"
            )
