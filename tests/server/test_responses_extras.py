"""``/v1/responses`` accepts and applies the sampling extras vLLM takes there (issue 41, 4b),
through the real ``openai`` SDK's ``extra_body``: guidellm's body (``stop``, ``ignore_eos``,
``max_output_tokens``) and SMG's (``top_k``, ``min_p``, ``repetition_penalty``,
``priority``, ``temperature``); a truly unknown field is still a 400 naming it. An item cut
by ``max_output_tokens`` is ``incomplete`` like its response (unary and streamed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from rest_harness import RestHarness
from server_harness import MODEL_NAME, ServerHarness

PROMPT = "Write a long story about a cat."


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, in_process=True)


@pytest.fixture(scope="module")
def rest(harness: ServerHarness) -> Iterator[RestHarness]:
    r = RestHarness(harness).start()
    yield r
    r.stop()


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("max_output_tokens", 16)
    kwargs.setdefault("temperature", 0.0)
    return client.responses.create(model=MODEL_NAME, input=PROMPT, store=False, **kwargs)


def test_guidellm_stop_and_ignore_eos(openai_client: openai.OpenAI) -> None:
    full = create(openai_client).output_text
    pairs = (full[i : i + 2] for i in range(1, len(full) - 1))
    stop = next(p for p in pairs if p.strip() == p)  # a stop string inside the text
    cut = create(openai_client, extra_body={"stop": [stop], "ignore_eos": True})
    assert cut.output_text == full[: full.index(stop)]
    assert cut.status == "completed" and cut.output[0].status == "completed"
    long = create(openai_client, max_output_tokens=24, extra_body={"ignore_eos": True})
    assert long.usage.output_tokens == 24 and long.status == "incomplete"


def test_smg_sampling_extras_take_effect(openai_client: openai.OpenAI) -> None:
    greedy = create(openai_client, extra_body={"repetition_penalty": 1.3}).output_text
    smg = {"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.3, "priority": 1}
    got = create(openai_client, temperature=1.0, extra_body=smg).output_text
    assert got == greedy  # top_k 1 at temperature 1 is greedy
    only_min_p = {"min_p": 1.0, "repetition_penalty": 1.3}
    assert create(openai_client, temperature=1.0, extra_body=only_min_p).output_text == greedy
    chat = openai_client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=16,
        temperature=1.0,
        extra_body=smg,
    )
    assert chat.choices[0].message.content == got


def test_unknown_field_is_still_400_naming_it(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        create(openai_client, extra_body={"min_p": 0.1, "no_such_knob": 1})
    assert caught.value.body["param"] == "no_such_knob"  # type: ignore[index]
    assert "no_such_knob" in caught.value.message


def test_a_cut_message_item_is_incomplete(openai_client: openai.OpenAI) -> None:
    cut = {"max_output_tokens": 4, "extra_body": {"ignore_eos": True}}
    unary = create(openai_client, **cut)
    assert unary.status == "incomplete"
    assert [(i.type, i.status) for i in unary.output] == [("message", "incomplete")]
    events = list(create(openai_client, stream=True, **cut))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status) for i in done] == [("message", "incomplete")]
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.status == "incomplete"
    assert [i.status for i in final.response.output] == ["incomplete"]
