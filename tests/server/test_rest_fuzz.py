"""Property-based fuzzing of the shim's own OpenAPI schema (schemathesis, positive and
negative cases) against the in-process server: no request may produce a 5xx, every error is
an OpenAI envelope, and afterwards the engine is idle and the server still answers."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from rest_harness import RestHarness
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from server_harness import ServerHarness

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 150


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_requests=64)


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_no_server_errors(rest: RestHarness, mode: GenerationMode) -> None:
    """Cases drawn from the served /openapi.json over every operation (schemathesis'
    strategies driven by hypothesis directly: its pytest plugin predates this pytest)."""
    schema = schemathesis.openapi.from_url(f"{rest.url}/openapi.json")
    seen: list[int] = []

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same cases every run: a failure is reproducible
        database=None,
    )
    def check(case: Any) -> None:
        body = case.body
        if isinstance(body, dict) and isinstance(body.get("model"), str) and len(body["model"]) % 2:
            body["model"] = "tiny"  # half the bodies reach generation, not only MODEL_NOT_FOUND
        response = case.call_and_validate(base_url=rest.url, checks=[not_a_server_error])
        seen.append(response.status_code)
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()
    assert all(status < 500 for status in seen) and len(seen) >= MAX_EXAMPLES // 2


def test_healthy_after_fuzzing(harness: ServerHarness, rest: RestHarness) -> None:
    harness.assert_idle()
    with httpx.Client(base_url=rest.url, timeout=60) as c:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3}
        assert c.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
        assert c.get("/ready").status_code == 200
