"""Request inputs that cross to the engine core (real gRPC server, the core in its own
process, so every input is encoded for the wire): a value the wire cannot carry is a bad
parameter of the call that sent it, refused before anything is registered or sent, never
an INTERNAL error that leaves the request counted in flight."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_helpers import details_of, greedy_request
from server_harness import ServerHarness

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.v1 import generation_pb2_grpc


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_requests=2)


@pytest.mark.parametrize("priority", ["9" * 25, str(2**64), str(-(2**63) - 1)])
def test_a_priority_the_wire_cannot_carry_is_invalid_argument(
    harness: ServerHarness, priority: str
) -> None:
    with harness.channel() as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for _ in range(3):  # more than max_requests: nothing may stay counted in flight
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(
                    greedy_request([5, 6, 7], 2),
                    metadata=(("x-priority", priority),),
                    timeout=30,
                )
            err = caught.value
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
            info, _ = details_of(err)
            assert info is not None and info.metadata["param"] == "x-priority"
        assert harness.engine.num_in_flight == 0
        reply = stub.Generate(
            greedy_request([5, 6, 7], 2), metadata=(("x-priority", "-7"),), timeout=30
        )
        assert len(reply.choices[0].token_ids) == 2
    harness.assert_idle()


def test_the_engine_front_refuses_what_it_cannot_send(harness: ServerHarness) -> None:
    """Below the gRPC server: a priority out of the wire's range is a ParameterError, and a
    request whose record fails to encode (a lone surrogate in cache_salt: only the offline
    API could pass one) fails its call and leaves nothing registered in the front."""
    engine = harness.engine

    async def add(**kwargs: Any) -> None:
        engine.add_request("wire-check", None, [5, 6, 7], SamplingParams(max_tokens=2), **kwargs)

    with pytest.raises(ParameterError, match="priority"):
        harness.run(add(priority=2**70))
    with pytest.raises(UnicodeEncodeError):
        harness.run(add(cache_salt="\ud800"))
    assert engine.num_in_flight == 0 and engine.num_seqs_in_flight == 0
    harness.assert_idle()
