"""Regression tests for defects items 2 and 3 on the engine side: the compile cache is bounded
by compiled bytes, the front's validator keeps no constraint text, a constraint that skipped
the front is still bounded in the core (per-request error, the core lives on), a compile
that outlives its limit fails only its request, and a Session turn's bomb stays in-band.
"""

from __future__ import annotations

import gc
import json
import queue
import threading
import time
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2
from grammar_probes import BOMB, SMALL_GENERATE_BOUND_S, HealthProbe, chat_request, small_generate
from server_harness import ServerHarness

from tokenwire.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenwire.runtime.engine.core import EngineCore
from tokenwire.runtime.front.structured_validate import StructuredValidator
from tokenwire.runtime.outputs import FinishReason
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.structured.compiler import GrammarCompilerPool
from tokenwire.runtime.structured.config import CACHE_BYTES_FLAG, StructuredOutputsConfig
from tokenwire.runtime.structured.params import GrammarSpec, StructuredOutputsParams
from tokenwire.v1 import common_pb2, generation_pb2_grpc
from tokenwire.v1 import generation_pb2 as pb


def enum_schema(tag: int, entries: int = 3000) -> str:
    """A distinct large enum (3000 entries: ~270 KB compiled with the default vocabulary)."""
    return json.dumps({"enum": [f"k{tag}-{i}" for i in range(entries)]})


def _finished(future: Future[Any]) -> threading.Event:
    """Set once every done callback registered before this one has run."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    return done


def test_compile_cache_stays_under_its_byte_bound(
    tiny_model_with_tokenizer: Path, smollm_tokenizer: Any
) -> None:
    bound = 1 << 20
    config = StructuredOutputsConfig(structured_outputs_cache_bytes=bound)
    pool = GrammarCompilerPool(str(tiny_model_with_tokenizer), len(smollm_tokenizer), (0,), config)
    sizes = []
    try:
        for tag in range(10):
            future = pool.submit(GrammarSpec("json", enum_schema(tag)))
            assert _finished(future).wait(120)
            sizes.append(future.result().memory_size_bytes)
            assert 0 < pool.cache_bytes <= bound, (tag, pool.cache_bytes)
        assert sum(sizes) > 2 * bound  # unbounded, the cache would hold all of them
        # The most recent grammar is still cached (the same future); the oldest is not.
        latest = GrammarSpec("json", enum_schema(9))
        assert pool.submit(latest).done()
        assert pool.cache_len < 10
        # A grammar larger than the whole bound is refused (naming the flag), not kept.
        tiny = GrammarCompilerPool(
            str(tiny_model_with_tokenizer),
            len(smollm_tokenizer),
            (0,),
            StructuredOutputsConfig(structured_outputs_cache_bytes=1000),
        )
        big = tiny.submit(GrammarSpec("json", enum_schema(0)))
        assert _finished(big).wait(120)
        assert CACHE_BYTES_FLAG in str(big.exception())
        assert tiny.cache_bytes == 0
        tiny.shutdown()
    finally:
        pool.shutdown()


def test_validator_keeps_no_constraint_text() -> None:
    """Before the fix the validator kept the last 256 accepted specs with their full text
    (256 MiB at 1 MiB each); now it keeps a 16-byte digest per verdict."""
    validator = StructuredValidator(has_tokenizer=True, capacity=64)
    warm = StructuredOutputsParams(json='{"type": "integer"}')  # imports xgrammar, starts a worker
    validator.check(SamplingParams(structured_outputs=warm))
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for tag in range(200):
            text = json.dumps({"enum": [f"t{tag}-{i}-{'x' * 20}" for i in range(1000)]})
            validator.check(SamplingParams(structured_outputs=StructuredOutputsParams(json=text)))
        del text
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        validator.close()
    assert validator.num_verdicts <= 64
    assert retained < 256 << 10, retained  # 64 texts of ~30 KB kept: ~2 MB


def _core(model_dir: Path) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), max_model_len=256),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        device="cpu",
    )
    return EngineCore(config)


def test_core_bounds_a_constraint_that_skipped_the_front(tiny_model_with_tokenizer: Path) -> None:
    """Straight into the core (no front check): the limits hold there too, as a per-request
    ERROR naming the field; a free request beside it runs, and the core serves on."""
    core = _core(tiny_model_with_tokenizer)
    try:
        bomb = SamplingParams(structured_outputs=StructuredOutputsParams(json=BOMB))
        core.add_request("bomb", [5, 6, 7], bomb)
        core.add_request("free", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        finished: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        while core.has_unfinished_requests() and time.monotonic() < deadline:
            finished.update((o.request_id, o) for o in core.step() if o.finished)
        assert finished["bomb"].finish_reason == FinishReason.ERROR
        assert finished["bomb"].error_param == "structured_outputs.json"
        assert "deeper than" in str(finished["bomb"].stop_reason)
        assert finished["free"].finish_reason == FinishReason.LENGTH
        core.kv_cache_manager.check_invariants(idle=True)
    finally:
        core.shutdown()


@pytest.fixture(scope="module")
def inproc(tiny_model_with_tokenizer: Path) -> Iterator[ServerHarness]:
    """The core on a thread of the server's process: a compile there shares its GIL."""
    h = ServerHarness(tiny_model_with_tokenizer, max_model_len=512, in_process=True).start()
    yield h
    h.stop()


def test_slow_compile_fails_its_request_only(inproc: ServerHarness) -> None:
    """Parses in milliseconds (the front accepts it), compiles for seconds: the request
    fails at the core's (lowered) limit; health and an unrelated Generate never wait."""
    saved = inproc.core.structured.pool.config
    inproc.core.structured.pool.config = StructuredOutputsConfig(compile_timeout=0.3)
    try:
        schema = json.dumps({"enum": [f"value-{i}" for i in range(10000)]})
        request = chat_request(common_pb2.StructuredOutput(json_schema=schema))
        with inproc.channel() as ch, HealthProbe(inproc.target) as probe:
            call = generation_pb2_grpc.GenerationServiceStub(ch).Generate.future(request)
            small = small_generate(inproc.target)
            err = call.exception(timeout=120)
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "compiling the constraint took longer than" in err.details(), err.details()
        probe.assert_free()
        assert small < SMALL_GENERATE_BOUND_S, small
    finally:
        inproc.core.structured.pool.config = saved
    inproc.assert_idle()


def test_session_turn_bomb_is_an_in_band_error(inproc: ServerHarness) -> None:
    outbox: queue.Queue[pb.SessionRequest | None] = queue.Queue()
    with inproc.channel() as ch, HealthProbe(inproc.target) as probe:
        replies = generation_pb2_grpc.GenerationServiceStub(ch).Session(iter(outbox.get, None))
        outbox.put(pb.SessionRequest(open=pb.SessionOpen()))
        assert next(replies).WhichOneof("message") == "opened"
        output = common_pb2.OutputOptions(
            structured_output=common_pb2.StructuredOutput(json_schema=BOMB)
        )
        turn = pb.SessionTurn(token_ids=common_pb2.TokenIds(ids=[5, 6, 7]), output=output)
        outbox.put(pb.SessionRequest(turn=turn))
        small = small_generate(inproc.target)
        end = next(replies)
        outbox.put(None)
    assert end.WhichOneof("message") == "turn_end", end
    assert end.turn_end.error.code == code_pb2.INVALID_ARGUMENT
    info = error_details_pb2.ErrorInfo()
    assert end.turn_end.error.details[0].Unpack(info)
    assert info.metadata["param"] == "structured_output.json_schema"
    assert "deeper than" in end.turn_end.error.message
    probe.assert_free()
    assert small < SMALL_GENERATE_BOUND_S, small
    inproc.assert_idle()


def test_grammar_over_the_cache_bound_is_invalid_argument_then_serves_on(
    inproc: ServerHarness,
) -> None:
    """Issue 41 item 2, served: with a 64 KiB ``--structured-outputs-cache-bytes`` a
    3000-entry enum (~270 KB compiled) gets INVALID_ARGUMENT naming the flag; health and a
    small Generate answer meanwhile, and the server answers afterwards."""
    pool = inproc.core.structured.pool
    saved = pool.config
    pool.config = StructuredOutputsConfig(structured_outputs_cache_bytes=64 << 10)
    try:
        request = chat_request(common_pb2.StructuredOutput(json_schema=enum_schema(41)))
        with inproc.channel() as ch, HealthProbe(inproc.target) as probe:
            call = generation_pb2_grpc.GenerationServiceStub(ch).Generate.future(request)
            small = small_generate(inproc.target)
            err = call.exception(timeout=120)
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert CACHE_BYTES_FLAG in err.details(), err.details()
        probe.assert_free()
        assert small < SMALL_GENERATE_BOUND_S, small
        assert pool.cache_bytes <= 64 << 10
        assert small_generate(inproc.target) < SMALL_GENERATE_BOUND_S  # still answering
    finally:
        pool.config = saved
    inproc.assert_idle()
