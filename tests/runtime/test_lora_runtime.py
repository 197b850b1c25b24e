"""Multi-LoRA in the runtime: greedy tokens equal transformers + peft per adapter, in mixed
batches, under adapter swaps (``--max-loras 1``), with prefix caching kept apart per adapter,
under tensor parallelism; bad adapters are refused with the field named and the engine serves
on; an unloaded adapter's running request finishes first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_checks import assert_llm_idle
from peft_reference import hf_lora_greedy, write_adapter

from tokenwire.runtime.errors import AdapterError, AdapterExistsError, AdapterNotFoundError
from tokenwire.runtime.executor.uniproc import UniprocExecutor
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.sampling_params import SamplingParams

# Engine runs over many prompts and families: in make test, not in make test-fast.
pytestmark = pytest.mark.slow

NEW_TOKENS = 8
PROMPTS = [list(range(5, 45)), [11, 12, 13], [40, 41, 42, 43, 44, 45, 46]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def setup(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    base = tiny_model_factory("llama")
    d = tmp_path_factory.mktemp("adapters")
    adapters = {
        "a": write_adapter(base, d / "a", rank=8, seed=1),
        "b": write_adapter(
            base, d / "b", rank=4, seed=2, targets=("q_proj", "v_proj", "down_proj"), rslora=True
        ),
        "c": write_adapter(
            base, d / "c", rank=16, alpha=8, seed=3, targets=("o_proj", "gate_proj", "up_proj")
        ),
    }
    refs: dict[str | None, list[list[int]]] = {
        None: hf_lora_greedy(base, None, PROMPTS, NEW_TOKENS)
    }
    for name, path in adapters.items():
        refs[name] = hf_lora_greedy(base, path, PROMPTS, NEW_TOKENS)
    for name in adapters:  # every adapter really changes the output
        assert refs[name] != refs[None]
    return {"base": base, "adapters": adapters, "refs": refs}


def make_llm(setup: dict[str, Any], **kwargs: Any) -> LLM:
    modules = tuple((name, str(path)) for name, path in setup["adapters"].items())
    kwargs.setdefault("max_loras", 3)
    return LLM(str(setup["base"]), device="cpu", enable_lora=True, lora_modules=modules, **kwargs)


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def runner_lora(llm: LLM) -> Any:
    executor = llm.engine.executor
    assert isinstance(executor, UniprocExecutor)
    return executor.worker.runner.lora


def test_each_adapter_matches_hf_peft(setup: dict[str, Any]) -> None:
    llm = make_llm(setup)
    for name in (None, "a", "b", "c"):
        lora = None if name is None else llm.engine.get_lora(name)
        got = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora))
        assert got == setup["refs"][name], name
    assert_llm_idle(llm)


@pytest.mark.parametrize("budget", [2048, 16])
def test_mixed_batch_gives_each_request_its_tokens_alone(
    setup: dict[str, Any], budget: int
) -> None:
    """Base + 3 adapters in one batch; a 16-token budget mixes prefill chunks and decodes
    of different adapters in one step."""
    llm = make_llm(setup, max_num_batched_tokens=budget, max_model_len=128)
    names: list[str | None] = [None, "a", "b", "c"]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [None if n is None else llm.engine.get_lora(n) for _ in PROMPTS for n in names]
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    for i, output in enumerate(got):
        assert output == setup["refs"][names[i % 4]][i // 4], (names[i % 4], i // 4)
    assert_llm_idle(llm)


def test_swaps_adapters_under_max_loras_1(setup: dict[str, Any]) -> None:
    """Three adapters in flight with one device slot and two CPU slots: the scheduler runs
    one adapter at a time (plus the base), the worker swaps slots and re-reads evicted ones."""
    llm = make_llm(setup, max_loras=1, max_cpu_loras=2)
    names: list[str | None] = ["a", "b", None, "c", "a"]
    loras = [None if n is None else llm.engine.get_lora(n) for n in names]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    for i, name in enumerate(names):
        assert got[i] == setup["refs"][name][i % len(PROMPTS)], name
    manager = runner_lora(llm)
    assert len(manager.resident) == 1 and len(manager.cached) <= 2
    assert_llm_idle(llm)


def test_prefix_cache_is_kept_apart_per_adapter(setup: dict[str, Any]) -> None:
    llm = make_llm(setup)
    prompt = [PROMPTS[0]]
    a, b = llm.engine.get_lora("a"), llm.engine.get_lora("b")
    first = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
    other = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=b)[0]
    base = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0  # no sharing
    assert again.num_cached_tokens >= 32  # the same adapter hits its own blocks
    assert tokens([again]) == [setup["refs"]["a"][0]]
    assert tokens([other]) == [setup["refs"]["b"][0]]
    assert_llm_idle(llm)


def test_bad_adapters_are_refused_and_the_engine_serves_on(
    setup: dict[str, Any],
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
) -> None:
    base = setup["base"]
    llm = make_llm(setup, max_lora_rank=16)
    engine = llm.engine
    too_big = write_adapter(base, tmp_path / "big", rank=32)
    embed = write_adapter(base, tmp_path / "embed", targets=("embed_tokens",))
    other_base = tiny_model_factory("llama", hidden_size=32, intermediate_size=64)
    wrong_shape = write_adapter(other_base, tmp_path / "shape")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        too_big: "adapter_config.json:r",
        embed: "adapter_config.json:target_modules",
        wrong_shape: "adapter_model.safetensors",
        empty: "lora_path",
        tmp_path / "missing": "lora_path",
    }
    for path, param in cases.items():
        with pytest.raises(AdapterError) as info:
            engine.add_lora("bad", str(path))
        assert info.value.param == param, (path, str(info.value))
        assert str(tmp_path) not in str(info.value)  # no file path in the message
    with pytest.raises(AdapterExistsError):
        engine.add_lora("a", str(setup["adapters"]["a"]))
    with pytest.raises(AdapterNotFoundError):
        engine.remove_lora("nope")
    ghost = LoRARequest("ghost", 99, str(setup["adapters"]["a"]))
    with pytest.raises(AdapterNotFoundError):
        engine.add_request("x", PROMPTS[1], GREEDY, lora_request=ghost)
    got = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=engine.get_lora("a")))
    assert got == setup["refs"]["a"]
    assert_llm_idle(llm)


def test_startup_errors_name_the_flag(setup: dict[str, Any], tmp_path: Path) -> None:
    big = write_adapter(setup["base"], tmp_path / "big", rank=32)
    with pytest.raises(ValueError, match="--lora-modules"):
        LLM(str(setup["base"]), device="cpu", enable_lora=True, lora_modules=(("big", str(big)),))
    with pytest.raises(ValueError, match="--enable-lora"):
        LLM(str(setup["base"]), device="cpu", lora_modules=(("a", str(big)),))
    plain = LLM(str(setup["base"]), device="cpu")
    with pytest.raises(AdapterError, match="--enable-lora"):
        plain.engine.add_lora("a", str(setup["adapters"]["a"]))


def test_unloading_lets_running_requests_finish(setup: dict[str, Any]) -> None:
    llm = make_llm(setup)
    engine = llm.engine
    lora = engine.get_lora("b")
    assert lora is not None
    engine.add_request("r", PROMPTS[0], GREEDY, lora_request=lora)
    out: list[int] = []
    out += [t for o in engine.step() for t in o.new_token_ids]
    engine.remove_lora("b")
    assert engine.get_lora("b") is None
    with pytest.raises(AdapterNotFoundError):
        engine.add_request("r2", PROMPTS[1], GREEDY, lora_request=lora)
    while engine.has_unfinished_requests():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert out == setup["refs"]["b"][0]
    engine.add_request("base", PROMPTS[1], GREEDY)  # the next step tells the worker
    while engine.has_unfinished_requests():
        engine.step()
    assert lora.lora_int_id not in runner_lora(llm).cached
    assert_llm_idle(llm)


def test_tp2_with_lora_equals_tp1(setup: dict[str, Any]) -> None:
    llm = make_llm(setup, tensor_parallel_size=2, max_loras=2)
    try:
        names: list[str | None] = ["a", None, "b", "c"]
        loras = [None if n is None else llm.engine.get_lora(n) for n in names]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
        got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
        for i, name in enumerate(names):
            assert got[i] == setup["refs"][name][i % len(PROMPTS)], name
        assert_llm_idle(llm)
    finally:
        llm.shutdown()
