"""#16: request fields of OpenAI and vLLM, through the real ``openai`` SDK against the real
shim. Fields that cannot change the answer are accepted (and the answer is the same as
without them); vLLM's ``continuous_usage_stats`` puts the usage so far on every chunk, as
guidellm expects; ``request_id`` and ``priority`` are honoured; fields that would change
the answer and are not implemented stay a 400 naming them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from rest_harness import RestHarness
from server_harness import MODEL_NAME, ServerHarness

ASK = [{"role": "user", "content": "Name a colour."}]
# What clients send by default or routinely (SDK keywords and vLLM extras) that cannot change
# the answer.
HARMLESS_CHAT: dict[str, Any] = {
    "user": "u-1",
    "safety_identifier": "s-1",
    "metadata": {"team": "search"},
    "service_tier": "auto",
    "store": True,
    "prompt_cache_key": "k-1",
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "prediction": {"type": "content", "content": "Blue."},
    "modalities": ["text"],
    "extra_body": {
        "prompt_cache_options": {"mode": "implicit"},
        "guided_decoding_backend": "xgrammar",
        "use_beam_search": False,
        "include_reasoning": True,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "add_special_tokens": False,
        "echo": False,
        "return_tokens_as_token_ids": False,
    },
}


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512)


def chat(openai_client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("seed", 7)
    return openai_client.chat.completions.create(model=MODEL_NAME, **kwargs)


def test_harmless_fields_are_accepted_and_change_nothing(
    harness: ServerHarness, openai_client: openai.OpenAI
) -> None:
    plain = chat(openai_client).choices[0].message.content
    assert chat(openai_client, **HARMLESS_CHAT).choices[0].message.content == plain
    text = openai_client.completions.create(model=MODEL_NAME, prompt="Red,", max_tokens=8, seed=7)
    same = openai_client.completions.create(
        model=MODEL_NAME,
        prompt="Red,",
        max_tokens=8,
        seed=7,
        best_of=1,
        suffix="",
        echo=False,
        user="u-1",
        extra_body={"metadata": {"a": "b"}, "store": False, "add_special_tokens": True},
    )
    assert same.choices[0].text == text.choices[0].text
    harness.assert_idle()


def _usages(stream: Any) -> tuple[list[Any], Any]:
    """Per-chunk usage of the chunks with choices, and the last (choice-less) chunk's."""
    per_chunk, final = [], None
    for chunk in stream:
        if chunk.choices:
            per_chunk.append(chunk.usage)
        else:
            final = chunk.usage
    return per_chunk, final


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_stream_options_of_guidellm(openai_client: openai.OpenAI, kind: str) -> None:
    def stream(options: dict[str, Any], n: int = 1) -> tuple[list[Any], Any]:
        common: dict[str, Any] = {"stream": True, "stream_options": options, "n": n, "seed": 7}
        if kind == "chat":
            return _usages(chat(openai_client, max_tokens=10, **common))
        return _usages(
            openai_client.completions.create(
                model=MODEL_NAME, prompt="Red,", max_tokens=10, **common
            )
        )

    per_chunk, final = stream({"include_usage": True, "continuous_usage_stats": False})
    assert all(u is None for u in per_chunk) and final.completion_tokens > 0
    for n in (1, 2):
        per_chunk, final = stream({"include_usage": True, "continuous_usage_stats": True}, n)
        assert per_chunk and all(u is not None for u in per_chunk)
        done = [u.completion_tokens for u in per_chunk]
        assert done == sorted(done) and done[-1] == final.completion_tokens
        assert {u.prompt_tokens for u in per_chunk} == {final.prompt_tokens}
        assert per_chunk[-1].total_tokens == final.total_tokens
    # continuous_usage_stats alone implies include_usage (vLLM's default).
    per_chunk, final = stream({"continuous_usage_stats": True})
    assert final is not None and per_chunk[-1].completion_tokens == final.completion_tokens


def test_request_id_and_priority_are_honoured(
    harness: ServerHarness, rest: RestHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, int]] = []
    add_request = harness.engine.add_request

    def record(request_id: str, *args: Any, **kwargs: Any) -> Any:
        seen.append((request_id, kwargs["priority"]))
        return add_request(request_id, *args, **kwargs)

    monkeypatch.setattr(harness.engine, "add_request", record)
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 2}
    with httpx.Client(base_url=rest.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={**body, "request_id": "mine-1", "priority": 5})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "chatcmpl-mine-1" and r.headers["x-request-id"] == "mine-1"
        assert seen[-1][0].endswith("mine-1") and seen[-1][1] == 5
        # The headers win over the body, as in vLLM.
        headers = {"x-request-id": "hdr-1", "x-priority": "3"}
        both = {**body, "request_id": "mine-2", "priority": 5}
        r = http.post("/v1/chat/completions", json=both, headers=headers)
        assert r.json()["id"] == "chatcmpl-hdr-1" and seen[-1][1] == 3
        bad = http.post("/v1/chat/completions", json={**body, "request_id": "no\nway"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"
    harness.assert_idle()


CHANGES_THE_ANSWER = [
    ("chat", {"verbosity": "low"}, "verbosity"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("chat", {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ("chat", {"service_tier": "gold"}, "service_tier"),
    ("chat", {"stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
    ("chat", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("chat", {"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ("chat", {"include_reasoning": False}, "include_reasoning"),
    ("chat", {"add_generation_prompt": False}, "add_generation_prompt"),
    ("chat", {"continue_final_message": True}, "continue_final_message"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("chat", {"use_beam_search": True}, "use_beam_search"),
    ("chat", {"allowed_token_ids": [10**6]}, "allowed_token_ids"),  # outside the vocab
    ("chat", {"bad_words": [" "]}, "bad_words"),  # blank
    ("chat", {"structural_tag": "{}"}, "structural_tag"),
    ("chat", {"return_token_ids": True}, "return_token_ids"),
    ("chat", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),  # < 1, not -1
    ("completions", {"add_special_tokens": False}, "add_special_tokens"),
]


@pytest.mark.parametrize(
    ("kind", "patch", "param"), CHANGES_THE_ANSWER, ids=[p for _, _, p in CHANGES_THE_ANSWER]
)
def test_fields_that_would_change_the_answer_are_400(
    rest: RestHarness, kind: str, patch: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 2, **patch}
    if kind == "chat":
        body["messages"] = ASK
    else:
        body["prompt"] = "Red,"
    with httpx.Client(base_url=rest.url, timeout=60) as http:
        r = http.post(f"/v1/{'chat/' if kind == 'chat' else ''}completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error
