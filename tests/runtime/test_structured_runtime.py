"""Constrained decoding in the runtime (xgrammar): parameters, bitmask plumbing, and the
offline engine on a tiny random model with the default model's real tokenizer.

A random-weight model samples whatever the mask lets through, so every schema, regex and
grammar here is exercised along many random paths: each output must still parse and
validate. Free requests batched with constrained ones must not notice them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from engine_checks import assert_llm_idle

from tokenwire.bench.structured_schemas import BOUNDED_SCHEMAS
from tokenwire.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenwire.runtime.engine.core import EngineCore
from tokenwire.runtime.engine.messages import AddRequest, ChildRequest
from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.structured_validate import StructuredValidator
from tokenwire.runtime.ipc.codec import InputCodec
from tokenwire.runtime.ipc.worker_messages import ExecutorCodec, Step
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.outputs import FinishReason
from tokenwire.runtime.sampling_params import SamplingParams, StructuredOutputsParams
from tokenwire.runtime.scheduler_output import CachedRequestData, SchedulerOutput
from tokenwire.runtime.structured.bitmask import GrammarBitmask
from tokenwire.runtime.structured.config import StructuredOutputsConfig
from tokenwire.runtime.worker.grammar_mask import apply_grammar_bitmask, disallowed_tokens

EOS = 2  # the tiny models' EOS (conftest); the SmolLM2 tokenizer's <|im_end|> is 2 as well
PROMPT = "Answer in JSON:"


def constrained(**kwargs: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_model_with_tokenizer: Path) -> LLM:
    return LLM(str(tiny_model_with_tokenizer), device="cpu", max_model_len=512)


# ---------------------------------------------------------------------------- parameters
@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({}, "structured_outputs"),
        ({"json": {"type": "object"}, "regex": "a+"}, "structured_outputs"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", ""]}, "structured_outputs.choice"),
        ({"json": ["not", "a", "schema"]}, "structured_outputs.json"),
        ({"json": {"x": float("nan")}}, "structured_outputs.json"),
    ],
)
def test_params_name_the_field(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(ParameterError) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == param


@pytest.mark.parametrize(
    ("kwargs", "param", "needle"),
    [
        ({"json": '{"type": "foo"}'}, "structured_outputs.json", 'Unsupported type "foo"'),
        ({"json": "{not json"}, "structured_outputs.json", "Failed to parse JSON"),
        ({"regex": "(ab"}, "structured_outputs.regex", "parenthesis is not closed"),
        ({"grammar": 'root ::= "a" | '}, "structured_outputs.grammar", "EBNF parser error"),
        ({"grammar": 'start ::= "a"'}, "structured_outputs.grammar", '"root" is not found'),
    ],
)
def test_validator_reports_the_compilers_message(
    kwargs: dict[str, Any], param: str, needle: str
) -> None:
    validator = StructuredValidator(has_tokenizer=True)
    params = SamplingParams(structured_outputs=constrained(**kwargs))
    with pytest.raises(ParameterError) as info:
        validator.check(params)
    assert info.value.param == param
    assert needle in str(info.value)
    assert ".cc" not in str(info.value) and "Check failed" not in str(info.value)


def test_validator_needs_a_tokenizer() -> None:
    params = SamplingParams(structured_outputs=constrained(regex="a"))
    with pytest.raises(ParameterError, match="no tokenizer"):
        StructuredValidator(has_tokenizer=False).check(params)


def test_params_survive_the_core_process_codec() -> None:
    """SamplingParams with each constraint kind cross the front -> core msgspec hop intact."""
    codec = InputCodec()
    for constraint in [
        constrained(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        constrained(json_object=True, disable_any_whitespace=True),
        constrained(regex=r"\d{3}"),
        constrained(choice=("yes", "no")),
        constrained(grammar='root ::= "x"'),
    ]:
        params = SamplingParams(temperature=0.0, structured_outputs=constraint)
        message = AddRequest("r", [1, 2], [ChildRequest("r", params)])
        decoded = codec.decode(codec.encode(message))
        assert decoded == message
        assert decoded.children[0].params.structured_outputs.spec() == constraint.spec()


def test_bitmask_survives_the_worker_codec() -> None:
    rng = np.random.default_rng(0)
    array = rng.integers(-(2**31), 2**31 - 1, size=(3, 5), dtype=np.int64).astype(np.int32)
    bitmask = GrammarBitmask.from_array(["a", "b", "c"], array)
    so = SchedulerOutput(1, [], CachedRequestData(), {"a": 1}, 1, 0, 1, frozenset(), frozenset())
    step = Step(dataclasses.replace(so, grammar_bitmask=bitmask))
    codec = ExecutorCodec()
    decoded = codec.decode(codec.encode(step)).scheduler_output.grammar_bitmask
    assert decoded == bitmask
    assert np.array_equal(decoded.to_array(), array)


def test_bitmask_application_matches_xgrammar_and_spares_free_rows() -> None:
    import xgrammar as xgr

    vocab, rows = 100, 4
    rng = np.random.default_rng(1)
    words = rng.integers(-(2**31), 2**31 - 1, size=(2, 4), dtype=np.int64).astype(np.int32)
    logits = torch.randn(rows, vocab)
    ours = logits.clone()
    # Requests "c" (row 3) and "a" (row 1) are constrained; "z" samples nothing this step.
    mask = GrammarBitmask.from_array(["c", "a"], words)
    apply_grammar_bitmask(ours, {"free0": 0, "a": 1, "free2": 2, "c": 3}, mask)
    ref = logits.clone()
    full = torch.full((rows, 4), -1, dtype=torch.int32)
    full[3], full[1] = torch.from_numpy(words[0]), torch.from_numpy(words[1])
    xgr.apply_token_bitmask_inplace(ref, full, vocab_size=vocab, indices=[1, 3])
    assert torch.equal(ours, ref)
    assert torch.equal(ours[0], logits[0]) and torch.equal(ours[2], logits[2])
    assert torch.isinf(ours[1]).any() and torch.isinf(ours[3]).any()
    # The accelerator path (shifts on the device) unpacks to the same mask.
    every = GrammarBitmask.from_array(["a", "c"], words)
    host = logits[[1, 3]].clone()
    apply_grammar_bitmask(host, {"a": 0, "c": 1}, every)
    assert torch.equal(disallowed_tokens(torch.from_numpy(words), vocab), torch.isinf(host))


# ---------------------------------------------------------------------------- the engine
def test_json_schemas_validate_under_random_sampling(llm: LLM) -> None:
    names = list(BOUNDED_SCHEMAS)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=100 + i,
            max_tokens=200,
            structured_outputs=constrained(json=BOUNDED_SCHEMAS[name], disable_any_whitespace=True),
        )
        for i, name in enumerate(names)
    ]
    outs = llm.generate([PROMPT] * len(names), params, use_tqdm=False)
    for name, out in zip(names, outs, strict=True):
        choice = out.outputs[0]
        assert choice.finish_reason == FinishReason.EOS, (name, choice.text)
        jsonschema.validate(json.loads(choice.text), BOUNDED_SCHEMAS[name])
    assert_llm_idle(llm)


def test_regex_choice_and_grammar(llm: LLM) -> None:
    grammar = """
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
"""
    cases = [
        constrained(regex=r"(ab|cd){2,4}-[0-9]{3}"),
        constrained(choice=("alpha", "beta gamma", 'quote"d')),
        constrained(grammar=grammar),
    ]
    params = [
        SamplingParams(temperature=1.0, seed=7 + 3 * i + j, max_tokens=80, structured_outputs=c)
        for i, c in enumerate(cases)
        for j in range(3)
    ]
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)]
    assert all(o.finish_reason == FinishReason.EOS for o in outs), [o.text for o in outs]
    for o in outs[0:3]:
        assert re.fullmatch(r"(ab|cd){2,4}-[0-9]{3}", o.text), o.text
    for o in outs[3:6]:
        assert o.text in ("alpha", "beta gamma", 'quote"d')
    for o in outs[6:9]:
        assert re.fullmatch(r"[0-9+\-()]+", o.text), o.text
        eval(o.text)  # digits, + - and parentheses only (checked above)
    assert len({o.text for o in outs}) > 4  # really sampled
    assert_llm_idle(llm)


def test_grammar_forbids_eos_until_complete(llm: LLM) -> None:
    """The model is pushed to EOS at every step (+100 logit bias), yet the grammar holds it
    back until the text is complete; the EOS it then samples ends the choice."""
    eager = {EOS: 100.0}
    free = SamplingParams(temperature=0.0, max_tokens=20, logit_bias=eager)
    assert llm.generate([PROMPT], free, use_tqdm=False)[0].outputs[0].token_ids == [EOS]
    target = "the quick brown fox jumps over the lazy dog"
    params = SamplingParams(
        temperature=0.0,
        max_tokens=60,
        logit_bias=eager,
        min_tokens=3,  # cannot hold back EOS once the grammar is complete
        structured_outputs=constrained(regex=re.escape(target)),
    )
    choice = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert choice.text == target
    assert choice.finish_reason == FinishReason.EOS and choice.token_ids[-1] == EOS
    assert_llm_idle(llm)


def test_free_requests_unaffected_by_constrained_neighbours(llm: LLM) -> None:
    free = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=42, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=43, top_k=50, max_tokens=24, logprobs=3),
    ]
    prompts = ["Once upon a time", "The weather today", "Numbers:"]
    alone = llm.generate(prompts, free, use_tqdm=False)
    busy = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=40,
            structured_outputs=constrained(json=BOUNDED_SCHEMAS["enums"]),
        )
        for i in range(4)
    ]
    mixed = llm.generate(
        [PROMPT, prompts[0], PROMPT, prompts[1], PROMPT, prompts[2], PROMPT],
        [busy[0], free[0], busy[1], free[1], busy[2], free[2], busy[3]],
        use_tqdm=False,
    )
    for solo, batched in zip(alone, [mixed[1], mixed[3], mixed[5]], strict=True):
        assert batched.outputs[0].token_ids == solo.outputs[0].token_ids
    lp_solo, lp_mixed = alone[2].outputs[0].logprobs, mixed[5].outputs[0].logprobs
    assert lp_solo is not None and lp_mixed is not None
    for a, b in zip(lp_solo, lp_mixed, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    assert_llm_idle(llm)


def test_n_choices_and_seeds(llm: LLM) -> None:
    schema = BOUNDED_SCHEMAS["array_of_objects"]
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=5,
        max_tokens=120,
        structured_outputs=constrained(json=schema, disable_any_whitespace=True),
    )
    first = llm.generate([PROMPT], params, use_tqdm=False)[0]
    texts = [c.text for c in first.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # the choices really differ
    again = llm.generate([PROMPT, "filler prompt"], [params, SamplingParams()], use_tqdm=False)
    assert [c.text for c in again[0].outputs] == texts  # seeded: same alone or batched
    assert_llm_idle(llm)


def test_logprobs_are_of_the_masked_distribution(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=4,
        logprobs=20,
        structured_outputs=constrained(choice=("yes", "no")),
    )
    choice = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert choice.text in ("yes", "no") and choice.logprobs is not None
    tokenizer = llm.get_tokenizer()
    first = choice.logprobs[0]
    finite = {t: lp.logprob for t, lp in first.items() if lp.logprob > float("-inf")}
    # Only tokens the grammar allows ("y", "ye", "yes", "n", "no", ...) carry probability,
    # and over them it sums to one; every other of the 20 listed is -inf.
    assert 2 <= len(finite) < len(first)
    for token in finite:
        text = tokenizer.decode([token])
        assert text and ("yes".startswith(text) or "no".startswith(text)), text
    assert sum(float(np.exp(v)) for v in finite.values()) == pytest.approx(1.0, abs=1e-4)
    # The last position could only be EOS: probability one.
    assert choice.logprobs[-1][EOS].logprob == pytest.approx(0.0, abs=1e-5)


def test_preemption_and_prefix_caching_keep_outputs(tiny_model_with_tokenizer: Path) -> None:
    """Few KV blocks: constrained requests are preempted and recomputed mid-output; their
    matchers stay in step with the kept tokens, so the outputs equal an unhurried run."""
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=80,
            structured_outputs=constrained(
                json=BOUNDED_SCHEMAS["nested_object"], disable_any_whitespace=True
            ),
        )
        for s in range(6)
    ]
    roomy = LLM(str(tiny_model_with_tokenizer), device="cpu", max_model_len=128)
    prompt = "Describe a person who lives in a city, as JSON:"
    expected = [o.outputs[0].text for o in roomy.generate([prompt] * 6, params, use_tqdm=False)]
    cramped = LLM(
        str(tiny_model_with_tokenizer),
        device="cpu",
        max_model_len=128,
        block_size=4,
        num_gpu_blocks_override=40,
    )
    outs = cramped.generate([prompt] * 6, params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == expected
    assert cramped.engine.scheduler.num_preemptions_total > 0
    assert_llm_idle(cramped)
    # The same prompt again: a prefix hit, the same constrained output.
    again = cramped.generate([prompt], params[0], use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].text == expected[0]
    assert_llm_idle(cramped)


def _core(model_dir: Path, structured: StructuredOutputsConfig | None = None) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), max_model_len=256),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        device="cpu",
        structured_outputs=structured or StructuredOutputsConfig(),
    )
    return EngineCore(config)


def _run(core: EngineCore) -> dict[str, Any]:
    finished = {}
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_grammar_failure_and_time_out_end_the_request(tiny_model_with_tokenizer: Path) -> None:
    """A grammar that fails to compile in the core (the front would have refused it) and a
    compile that outlives its time limit each end their request with ERROR naming the field,
    while a free request beside them runs normally."""
    core = _core(tiny_model_with_tokenizer)
    bad = SamplingParams(structured_outputs=constrained(grammar="root ::= nowhere"))
    core.add_request("bad", [5, 6, 7], bad)
    core.add_request("free", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    finished = _run(core)
    assert finished["bad"].finish_reason == FinishReason.ERROR
    assert finished["bad"].error_param == "structured_outputs.grammar"
    assert 'Rule "nowhere" is not defined' in str(finished["bad"].stop_reason)
    assert finished["free"].finish_reason == FinishReason.LENGTH
    core.kv_cache_manager.check_invariants(idle=True)
    core.shutdown()

    slow = _core(tiny_model_with_tokenizer, StructuredOutputsConfig(compile_timeout=1e-6))
    slow.add_request("late", [5, 6], SamplingParams(structured_outputs=constrained(regex="a")))
    late = _run(slow)["late"]
    assert late.finish_reason == FinishReason.ERROR
    assert late.error_param == "structured_outputs.regex"
    assert "took longer than" in str(late.stop_reason)
    slow.kv_cache_manager.check_invariants(idle=True)
    slow.shutdown()


def test_invalid_constraint_refused_before_queueing(llm: LLM) -> None:
    params = SamplingParams(structured_outputs=constrained(json='{"type": "object", "x": ['))
    with pytest.raises(ParameterError) as info:
        llm.generate([PROMPT, PROMPT], [SamplingParams(), params], use_tqdm=False)
    assert info.value.param == "structured_outputs.json"
    assert_llm_idle(llm)
