"""tokenwire runtime: scheduler, block manager, executor, models, sampler, offline ``LLM``.

Heavy members (``LLM`` pulls in torch and transformers) load lazily so that the torch-free
parts (scheduler, block manager) import without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenwire.runtime.outputs import CompletionOutput, FinishReason, Logprob, RequestOutput
from tokenwire.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenwire.runtime.llm import LLM

__all__ = ["LLM", "CompletionOutput", "FinishReason", "Logprob", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenwire.runtime.llm import LLM

        return LLM
    raise AttributeError(name)
