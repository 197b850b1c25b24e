"""The one idle check for the offline engine: after any run, cancel or failure nothing is left
unfinished, the block manager's invariants hold for an idle cache, and every KV block is free."""

from __future__ import annotations

from tokenwire.runtime.llm import LLM


def assert_llm_idle(llm: LLM) -> None:
    engine = llm.engine
    kv = engine.kv_cache_manager
    assert not engine.has_unfinished_requests()
    kv.check_invariants(idle=True)
    assert kv.num_free_blocks == kv.num_blocks
