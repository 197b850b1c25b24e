"""``--cpu-fused-layers``: the default model's decoder stack runs as one operator on CPU
(``kernels.fused_layers``, chosen by ``runtime.models.fused_stack``).

Which models get it (the default model where the VNNI kernel runs; not with the flag off,
``--dtype float32`` or linears that are not VNNI weights), that a LoRA-style swap of the linears
sends the model back to its torch layers, and end to end: the same greedy tokens as the
torch layers on chat prompts, and a prompt alone equals itself inside a batch of 16 at two
threads (where torch's sdpa is not batch invariant).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from tokenwire.kernels.vnni_matmul import vnni_status
from tokenwire.runtime.front.tokenizer import apply_chat_template
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.fused_stack import FusedModel, fused_stack_reason
from tokenwire.runtime.models.llama import LlamaForCausalLM, build_model
from tokenwire.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not vnni_status().loaded, reason=f"no VNNI kernel here: {vnni_status().reason}"
)
TOPICS = [
    "copper", "dragons", "cats", "the sea", "the sky", "airplanes", "Paris", "volcanoes",
    "bees", "chess", "rain", "trains", "bread", "the moon", "glass", "rivers",
]  # fmt: skip
SMALL = {"max_model_len": 256, "num_gpu_blocks_override": 64}


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _model(llm: LLM) -> LlamaForCausalLM:
    model = llm.engine.executor.worker.runner.model  # type: ignore[attr-defined]
    assert isinstance(model, LlamaForCausalLM)
    return model


def _prompts(llm: LLM, n: int) -> list[str]:
    tokenizer = llm.get_tokenizer()
    return [
        apply_chat_template(tokenizer, [{"role": "user", "content": f"Tell me about {t}."}])
        for t in TOPICS[:n]
    ]


def test_the_default_model_runs_fused_and_the_flag_turns_it_off() -> None:
    fused = _model(LLM(None, **SMALL))
    assert isinstance(fused.__dict__.get("_fused"), FusedModel)
    assert fused_stack_reason(fused.stack_parts()) is None
    for off in ({"cpu_fused_layers": False}, {"dtype": "float32"}):
        assert _model(LLM(None, **SMALL, **off)).__dict__.get("_fused") is None  # type: ignore[arg-type]


def test_models_it_cannot_run_say_why() -> None:
    arch = ModelArch(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
        tie_word_embeddings=True, attention_bias=False, o_proj_bias=False, qk_norm=False,
        sliding_window=None, bos_token_id=None, eos_token_ids=(0,),
    )  # fmt: skip
    model = build_model(arch, torch.device("cpu"), torch.float32, max_position=128)
    assert fused_stack_reason(model.stack_parts()) == "linears that are not VNNI weights"
    qk_norm = ModelArch(**{**arch.__dict__, "qk_norm": True})
    model = build_model(qk_norm, torch.device("cpu"), torch.float32, max_position=128)
    assert "q/k norms" in (fused_stack_reason(model.stack_parts()) or "")


def test_swapped_linears_send_the_model_back_to_its_torch_layers() -> None:
    llm = LLM(None, **SMALL)
    model = _model(llm)
    fused = model.__dict__["_fused"]
    assert fused.current(model.model.layers)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    before = llm.generate(_prompts(llm, 1), greedy, use_tqdm=False)[0].outputs[0].token_ids
    attn = model.model.layers[0].self_attn

    class Wrapped(nn.Module):  # what the LoRA manager does: a wrapper calling the base layer
        def __init__(self, base: nn.Module) -> None:
            super().__init__()
            self.base = base
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            out: torch.Tensor = self.base(x)
            return out

    wrapper = Wrapped(attn.qkv_proj)
    attn.qkv_proj = wrapper
    assert not fused.current(model.model.layers)
    after = llm.generate(_prompts(llm, 1), greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert wrapper.calls > 0  # the torch layers ran
    assert after == before  # and agree on these tokens


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_same_greedy_tokens_as_the_torch_layers() -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    outputs = []
    for fused in (True, False):
        llm = LLM(None, cpu_fused_layers=fused, **SMALL)
        done = llm.generate(_prompts(llm, 4), greedy, use_tqdm=False)
        outputs.append([o.outputs[0].token_ids for o in done])
    assert outputs[0] == outputs[1]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_prompt_alone_equals_itself_inside_a_batch_of_16(two_threads: None) -> None:
    llm = LLM(None, max_model_len=512)
    prompts = _prompts(llm, 16)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)
    batch = llm.generate(prompts, greedy, use_tqdm=False)
    for i in (0, 7, 15):
        alone = llm.generate([prompts[i]], greedy, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == batch[i].outputs[0].token_ids, f"prompt {i} differs"
        assert alone.logprobs == batch[i].outputs[0].logprobs, f"prompt {i}'s logprobs differ"
