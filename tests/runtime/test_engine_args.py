"""One definition of the engine flags (``runtime/engine_args.py``): every flag parses on
``serve``, ``generate``, ``bench throughput`` and ``bench overhead`` with the same name, the
defaults are the config dataclasses', ``LLM(**kwargs)`` takes every field and refuses unknown
ones, and a bad value names its flag."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tokenwire.runtime.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenwire.runtime.engine_args import EngineArgs, engine_flags, flag_of, flag_spec
from tokenwire.runtime.kv_events_config import KVEventsConfig
from tokenwire.runtime.pooling_params import PoolerConfig
from tokenwire.runtime.structured.config import StructuredOutputsConfig
from tokenwire.server.cli import build_parser

COMMANDS = {
    "serve": ("serve",),
    "generate": ("generate",),
    "bench throughput": ("bench", "throughput"),
    "bench overhead": ("bench", "overhead"),
    "bench lora": ("bench", "lora"),
    "worker": ("worker",),
}
FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]

# A value for every field, none of them the default (what the flags below parse to).
VALUES: dict[str, Any] = {
    "model": "some/model",
    "tokenizer": "some/tokenizer",
    "served_model_name": "served",
    "dtype": "bfloat16",
    "device": "cpu",
    "max_model_len": 512,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 1024,
    "encoder_cache_size": 4096,
    "max_num_encoder_input_tokens": 512,
    "block_size": 32,
    "gpu_memory_utilization": 0.5,
    "kv_cache_memory": 1 << 20,
    "kv_cache_dtype": "fp8",
    "lm_head_dtype": "bfloat16",
    "cpu_quant_kernel": "torch",
    "cpu_fused_layers": False,
    "num_gpu_blocks_override": 64,
    "kv_offloading_size": 1.5,
    "kv_offloading_disk_path": "/var/cache/kv",
    "kv_offloading_disk_size": 8.0,
    "kv_offloading_eviction_policy": "arc",
    "enable_prefix_caching": False,
    "enable_chunked_prefill": False,
    "async_scheduling": True,
    "scheduling_policy": "priority",
    "tensor_parallel_size": 2,
    "data_parallel_size": 2,
    "distributed_init_method": "tcp://10.0.0.1:29400",
    "nnodes": 2,
    "node_rank": 1,
    "master_addr": "10.0.0.1",
    "master_port": 29400,
    "distributed_timeout": 20.0,
    "distributed_startup_timeout": 120.0,
    "enforce_eager": True,
    "cpu_compile": True,
    "load_format": "dummy",
    "seed": 7,
    "quantization": "int8",
    "enable_lora": True,
    "lora_modules": (("a", "/adapters/a"), ("b", "/adapters/b")),
    "max_loras": 2,
    "max_lora_rank": 32,
    "max_cpu_loras": 4,
    "revision": "v1.0",
    "tokenizer_revision": "tok-v2",
    "download_dir": "/hf-cache",
    "chat_template": "/templates/chat.jinja",
    "generation_config": "vllm",
    "allow_content_special_tokens": True,
    "speculative_config": SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4),
    "kv_events_config": KVEventsConfig(enable_kv_cache_events=True, topic="kv"),
    "task": "embed",
    "pooler_config": PoolerConfig(pooling_type="MEAN", normalize=False),
    "structured_outputs_cache_bytes": 64 << 20,
}


def subparser(command: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = build_parser()
    for name in COMMANDS[command]:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def positionals(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions if not a.option_strings}


def argv_for(command: str) -> list[str]:
    """Flags setting every field to ``VALUES`` (the model positional except on generate)."""
    argv = ["hello"] if command == "generate" else [VALUES["model"]]
    if command == "generate":
        argv += ["--model", VALUES["model"]]
    for name, value in VALUES.items():
        if name == "model":
            continue
        flag = flag_of(name)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif isinstance(value, tuple):  # --lora-modules NAME=PATH ...
            argv += [flag, *(f"{name}={path}" for name, path in value)]
        elif isinstance(value, SpeculativeConfig | KVEventsConfig | PoolerConfig):  # vLLM's JSON
            argv += [flag, json.dumps(dataclasses.asdict(value))]
        else:
            argv += [flag, str(value)]
    return argv


def test_values_cover_every_field_and_differ_from_defaults() -> None:
    assert set(VALUES) == set(FIELDS)
    defaults = EngineArgs()
    changed = {n for n in FIELDS if getattr(defaults, n) != VALUES[n]}
    assert changed == set(FIELDS)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_engine_flag_parses_on_every_command(command: str) -> None:
    parser = subparser(command)
    expected = set(engine_flags())
    if command != "generate":  # MODEL is positional there; generate's positional is the prompt
        expected.discard("--model")
        assert "model" in positionals(parser)
    assert expected <= option_strings(parser), expected - option_strings(parser)
    args = parser.parse_args(argv_for(command))
    assert EngineArgs.from_cli_args(args) == EngineArgs(**VALUES)


def test_the_same_engine_flags_everywhere() -> None:
    """Not a subset each: the engine option strings of all four commands are the same set."""
    flags = set(engine_flags())
    found = {c: option_strings(subparser(c)) & (flags | {"--model"}) for c in COMMANDS}
    found = {c: s - {"--model"} for c, s in found.items()}
    assert len({frozenset(s) for s in found.values()}) == 1, found


def _config_default(config: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(config) if f.name == name)


def test_defaults_are_the_config_dataclasses() -> None:
    config = EngineArgs().create_engine_config()
    assert config == EngineConfig()
    for name in FIELDS:
        spec = flag_spec(name)
        assert getattr(EngineArgs(), name) == _config_default(spec.config, spec.config_field)
    assert {flag_spec(n).config for n in FIELDS} == {
        ModelConfig,
        CacheConfig,
        SchedulerConfig,
        ParallelConfig,
        LoRAConfig,
        StructuredOutputsConfig,
        EngineConfig,
    }


@pytest.mark.parametrize("command", list(COMMANDS))
def test_parser_defaults_are_the_config_defaults(command: str) -> None:
    argv = ["hello"] if command == "generate" else []
    args = subparser(command).parse_args(argv)
    assert EngineArgs.from_cli_args(args) == EngineArgs()


def test_create_engine_config_carries_every_field() -> None:
    config = EngineArgs(**VALUES).create_engine_config()
    assert config.model == ModelConfig(
        model="some/model", tokenizer="some/tokenizer", dtype="bfloat16", max_model_len=512,
        lm_head_dtype="bfloat16", cpu_quant_kernel="torch", cpu_fused_layers=False,
        load_format="dummy", seed=7, served_model_name="served", quantization="int8",
        revision="v1.0", tokenizer_revision="tok-v2", download_dir="/hf-cache",
        chat_template="/templates/chat.jinja", generation_config="vllm",
        allow_content_special_tokens=True, task="embed",
        pooler_config=PoolerConfig(pooling_type="MEAN", normalize=False),
    )  # fmt: skip
    assert config.cache == CacheConfig(
        block_size=32, enable_prefix_caching=False, kv_cache_memory=1 << 20,
        gpu_memory_utilization=0.5, num_gpu_blocks_override=64, kv_cache_dtype="fp8",
        kv_offloading_size=1.5, kv_offloading_disk_path="/var/cache/kv",
        kv_offloading_disk_size=8.0, kv_offloading_eviction_policy="arc",
    )  # fmt: skip
    assert config.scheduler == SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=1024, scheduling_policy="priority",
        enable_chunked_prefill=False, async_scheduling=True, encoder_cache_size=4096,
        max_num_encoder_input_tokens=512,
    )  # fmt: skip
    assert config.parallel == ParallelConfig(
        tensor_parallel_size=2, data_parallel_size=2, nnodes=2,
        distributed_init_method="tcp://10.0.0.1:29400",
        node_rank=1, master_addr="10.0.0.1", master_port=29400, distributed_timeout=20.0,
        distributed_startup_timeout=120.0,
    )  # fmt: skip
    assert config.lora == LoRAConfig(
        enable_lora=True, lora_modules=(("a", "/adapters/a"), ("b", "/adapters/b")),
        max_loras=2, max_lora_rank=32, max_cpu_loras=4,
    )  # fmt: skip
    assert config.speculative_config == VALUES["speculative_config"]
    assert (config.device, config.enforce_eager) == ("cpu", True)


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("max_model_len", 0, "--max-model-len"),
        ("max_num_seqs", 0, "--max-num-seqs"),
        ("max_num_batched_tokens", -1, "--max-num-batched-tokens"),
        ("encoder_cache_size", 0, "--encoder-cache-size"),
        ("max_num_encoder_input_tokens", -1, "--max-num-encoder-input-tokens"),
        ("block_size", 24, "--block-size"),
        ("gpu_memory_utilization", 1.5, "--gpu-memory-utilization"),
        ("kv_cache_memory", 0, "--kv-cache-memory"),
        ("num_gpu_blocks_override", 1, "--num-gpu-blocks-override"),
        ("kv_offloading_disk_size", -1.0, "--kv-offloading-disk-size"),
        ("kv_offloading_disk_path", "/x", "--kv-offloading-disk-path"),
        ("scheduling_policy", "lifo", "--scheduling-policy"),
        ("tensor_parallel_size", 0, "--tensor-parallel-size"),
        ("nnodes", 0, "--nnodes"),
        ("node_rank", 3, "--node-rank"),
        ("master_port", 70000, "--master-port"),
        ("distributed_init_method", "udp://x", "--distributed-init-method"),
        ("device", "tpu", "--device"),
        ("dtype", "int3", "--dtype"),
        ("load_format", "pickle", "--load-format"),
        ("max_loras", 0, "--max-loras"),
        ("max_lora_rank", -1, "--max-lora-rank"),
        ("max_cpu_loras", 0, "--max-cpu-loras"),
        ("lora_modules", (("a", "/x"),), "--lora-modules"),
    ],
)
def test_a_bad_value_names_its_flag(field: str, value: Any, flag: str) -> None:
    with pytest.raises(ValueError, match=f"^{flag} ") as err:
        EngineArgs(**{field: value}).create_engine_config()
    assert "_" not in str(err.value).split(" ")[0]


def test_cross_field_error_names_both_flags() -> None:
    args = EngineArgs(max_model_len=4096, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"^--max-num-batched-tokens .*--max-model-len"):
        args.create_engine_config()


def test_ranks_must_split_evenly_over_nodes() -> None:
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size .* nnodes"):
        EngineArgs(tensor_parallel_size=3, nnodes=2).create_engine_config()
    config = EngineArgs(tensor_parallel_size=4, nnodes=2).create_engine_config()
    assert config.parallel.ranks_per_node == 2


def test_serve_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from tokenwire.server.cli import main

    assert main(["serve", "--block-size", "24", "--grpc-port", "0", "--port", "0"]) == 2
    assert "--block-size must be a power of two" in capsys.readouterr().err


def test_choices_come_from_the_config_literals() -> None:
    parser = subparser("serve")
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int3"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--load-format", "pickle"])
    assert flag_spec("dtype").choices == ("auto", "float32", "float16", "bfloat16")
    assert flag_spec("scheduling_policy").choices == ("fcfs", "priority")


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("4096", 4096),
        ("8k", 8000),  # vLLM: lower case is decimal ...
        ("8K", 8192),  # ... upper case binary
        ("25.6k", 25600),
        ("1m", 1_000_000),
        ("1M", 1 << 20),
        ("auto", None),  # the model's own
        ("-1", None),
    ],
)
def test_max_model_len_forms(text: str, tokens: int | None) -> None:
    args = subparser("serve").parse_args(["--max-model-len", text])
    assert args.max_model_len == tokens
    config = EngineArgs(max_model_len=text).create_engine_config()  # LLM(max_model_len="8k")
    assert config.model.max_model_len == tokens


def test_bad_max_model_len_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        subparser("serve").parse_args(["--max-model-len", "8.5K"])
    assert "argument --max-model-len: expected auto, an integer" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^--max-model-len expected auto"):
        EngineArgs(max_model_len="lots").create_engine_config()


# ---------------------------------------------------------------------- LLM(**kwargs)
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def test_llm_accepts_every_engine_field(tmp_path: Path) -> None:
    from tokenwire.runtime.llm import LLM
    from tokenwire.runtime.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    kwargs = dict(VALUES)
    kwargs.update(
        model=str(tmp_path), tokenizer=None, dtype="float32", max_model_len=128,
        max_num_batched_tokens=128,
        # One rank on one node here: tensor parallelism runs in
        # tests/runtime/test_tensor_parallel.py.
        tensor_parallel_size=1, nnodes=1, node_rank=0, distributed_init_method=None,
        data_parallel_size=1,  # one core offline; DP: tests/e2e/test_data_parallel_serve.py
        lora_modules=(),  # adapters are loaded in tests/runtime/test_lora_runtime.py
        chat_template=None,  # templates are rendered in tests/server/test_generation_config.py
        task="generate",  # embeddings: tests/runtime/test_embeddings_engine.py
    )  # fmt: skip
    llm = LLM(**kwargs)
    assert llm.engine.facts.num_blocks == 64
    assert llm.engine.facts.served_model_name == "served"
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    same = LLM.from_engine_args(EngineArgs(**kwargs))
    assert same.engine.facts.num_blocks == 64


def test_llm_rejects_an_unknown_field_and_names_a_bad_flag() -> None:
    from tokenwire.runtime.llm import LLM

    with pytest.raises(TypeError, match="no_such_flag"):
        LLM(no_such_flag=1)
    with pytest.raises(ValueError, match=r"^--max-num-seqs "):
        LLM(max_num_seqs=0)  # refused before any model work


def test_bench_overhead_runs_with_engine_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from tokenwire.server.cli import main

    argv = ["bench", "overhead", "--device", "cpu", "--max-num-seqs", "4", "--output-len", "6"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "overhead" and result["num_seqs"] == 4
    assert result["decode_steps"] > 0
    assert main([*argv, "--num-seqs", "5"]) == 2
    assert "--max-num-seqs" in capsys.readouterr().err
