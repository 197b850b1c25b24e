"""Issue 41 item 2: the engine core's compiled-grammar cache is bounded by bytes
(``--structured-outputs-cache-bytes``), and a grammar that alone would not fit the bound is
refused (its request ends with ERROR naming the flag; the core serves on)."""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from tokenwire.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenwire.runtime.engine.core import EngineCore
from tokenwire.runtime.engine_args import EngineArgs, flag_of
from tokenwire.runtime.outputs import FinishReason
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.structured.compiler import GrammarCompilerPool
from tokenwire.runtime.structured.config import CACHE_BYTES_FLAG, StructuredOutputsConfig
from tokenwire.runtime.structured.params import GrammarSpec, StructuredOutputsParams

SMALL_BOUND = 64 << 10  # a 3000-entry enum compiles to ~270 KB with the SmolLM2 vocabulary


def enum_schema(tag: int, entries: int = 3000) -> str:
    return json.dumps({"enum": [f"t{tag}-{i}" for i in range(entries)]})


def _settled(future: Future[Any], timeout: float = 120) -> None:
    """Wait until every done callback registered before this one (the pool's) has run."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    assert done.wait(timeout)


def _pool(model_dir: Path, tokenizer: Any, bound: int) -> GrammarCompilerPool:
    config = StructuredOutputsConfig(structured_outputs_cache_bytes=bound)
    return GrammarCompilerPool(str(model_dir), len(tokenizer), (0,), config)


def test_flag_sets_the_bound_and_names_itself_when_bad() -> None:
    assert flag_of("structured_outputs_cache_bytes") == CACHE_BYTES_FLAG
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args([CACHE_BYTES_FLAG, str(3 << 20)])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.structured_outputs.structured_outputs_cache_bytes == 3 << 20
    default = EngineArgs().create_engine_config().structured_outputs.structured_outputs_cache_bytes
    assert default == StructuredOutputsConfig().structured_outputs_cache_bytes == 512 << 20
    with pytest.raises(ValueError, match=CACHE_BYTES_FLAG):
        EngineArgs(structured_outputs_cache_bytes=0).create_engine_config()


def test_distinct_large_schemas_stay_within_the_byte_bound(
    tiny_model_with_tokenizer: Path, smollm_tokenizer: Any
) -> None:
    bound = 1 << 20
    pool = _pool(tiny_model_with_tokenizer, smollm_tokenizer, bound)
    sizes: list[int] = []
    try:
        for tag in range(8):
            future = pool.submit(GrammarSpec("json", enum_schema(tag)))
            _settled(future)
            sizes.append(int(future.result().memory_size_bytes))
            del future
            assert 0 < pool.cache_bytes <= bound, (tag, pool.cache_bytes)
        assert sum(sizes) > 2 * bound  # kept by count alone, all eight would stay
        assert pool.cache_len < 8
        # Recently used: still cached (the finished future comes back); the oldest: dropped.
        assert pool.submit(GrammarSpec("json", enum_schema(7))).done()
        again = pool.submit(GrammarSpec("json", enum_schema(0)))
        assert not again.done()
        _settled(again)
        assert pool.cache_bytes <= bound
    finally:
        pool.shutdown()


def test_grammar_larger_than_the_bound_is_refused_naming_the_flag(
    tiny_model_with_tokenizer: Path, smollm_tokenizer: Any
) -> None:
    pool = _pool(tiny_model_with_tokenizer, smollm_tokenizer, SMALL_BOUND)
    try:
        spec = GrammarSpec("json", enum_schema(0))
        big = pool.submit(spec)
        _settled(big)
        error = big.exception()
        assert isinstance(error, ValueError), error
        assert CACHE_BYTES_FLAG in str(error) and str(SMALL_BOUND) in str(error), error
        assert pool.cache_bytes == 0
        assert pool.submit(spec) is big  # the refusal is remembered: no second compile
        small = pool.submit(GrammarSpec("regex", "[ab]{1,4}"))
        _settled(small)
        assert 0 < small.result().memory_size_bytes <= SMALL_BOUND
        assert pool.cache_bytes == small.result().memory_size_bytes
    finally:
        pool.shutdown()


def test_core_refuses_the_oversize_request_only(tiny_model_with_tokenizer: Path) -> None:
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_with_tokenizer), max_model_len=256),
        cache=CacheConfig(kv_cache_memory=8 << 20),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        structured_outputs=StructuredOutputsConfig(structured_outputs_cache_bytes=SMALL_BOUND),
        device="cpu",
    )
    core = EngineCore(config)
    try:
        big = SamplingParams(structured_outputs=StructuredOutputsParams(json=enum_schema(1)))
        core.add_request("big", [5, 6, 7], big)
        core.add_request("free", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        finished: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        while core.has_unfinished_requests() and time.monotonic() < deadline:
            finished.update((o.request_id, o) for o in core.step() if o.finished)
        assert finished["big"].finish_reason == FinishReason.ERROR
        assert finished["big"].error_param == "structured_outputs.json"
        assert CACHE_BYTES_FLAG in str(finished["big"].stop_reason)
        assert finished["free"].finish_reason == FinishReason.LENGTH
        # The core serves on: a constraint within the bound still runs.
        fits = SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]{1,4}")
        )
        core.add_request("fits", [5, 6, 7], fits)
        while core.has_unfinished_requests() and time.monotonic() < deadline:
            finished.update((o.request_id, o) for o in core.step() if o.finished)
        assert finished["fits"].finish_reason != FinishReason.ERROR, finished["fits"]
        assert 0 < core.structured.pool.cache_bytes <= SMALL_BOUND
        core.kv_cache_manager.check_invariants(idle=True)
    finally:
        core.shutdown()
