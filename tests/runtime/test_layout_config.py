"""Config is derived once (layout item 5): every ``EngineArgs`` field names the config field it
sets (the same name as the field, the flag and the ``LLM`` keyword), ``create_engine_config``
builds the config objects from those declarations, every field reaches exactly that one config
field, and every config field that is a user setting has a flag. ``StructuredOutputsConfig``
is part of ``EngineConfig``."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest

from tokenwire.runtime.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenwire.runtime.engine_args import EngineArgs, flag_of, flag_spec
from tokenwire.runtime.kv_events_config import KVEventsConfig
from tokenwire.runtime.pooling_params import PoolerConfig
from tokenwire.runtime.structured.config import StructuredOutputsConfig
from tokenwire.server.cli import build_parser

FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]

# A value for every field, none of them the default.
VALUES: dict[str, Any] = {
    "model": "some/model",
    "tokenizer": "some/tokenizer",
    "revision": "v1.0",
    "tokenizer_revision": "tok-v2",
    "download_dir": "/hf-cache",
    "served_model_name": "served",
    "chat_template": "/templates/chat.jinja",
    "generation_config": "vllm",
    "allow_content_special_tokens": True,
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
    "num_gpu_blocks_override": 64,
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
    "lora_modules": (("a", "/adapters/a"),),
    "max_loras": 2,
    "max_lora_rank": 32,
    "max_cpu_loras": 4,
    "speculative_config": SpeculativeConfig(num_speculative_tokens=3),
    "task": "embed",
    "pooler_config": PoolerConfig(pooling_type="CLS", normalize=False),
    "kv_events_config": KVEventsConfig(enable_kv_cache_events=True, topic="kv"),
    "kv_offloading_size": 0.5,
    "kv_offloading_disk_path": "/var/cache/kv",
    "kv_offloading_disk_size": 4.0,
    "kv_offloading_eviction_policy": "arc",
    "structured_outputs_cache_bytes": 64 << 20,
    "lm_head_dtype": "bfloat16",
    "cpu_quant_kernel": "torch",
    "cpu_fused_layers": False,
}
# What a field's value is only valid together with (set in both configs compared).
COMPANIONS: dict[str, dict[str, Any]] = {
    "lora_modules": {"enable_lora": True},
    "kv_offloading_disk_path": {"kv_offloading_size": 0.5, "kv_offloading_disk_size": 4.0},
    "nnodes": {"tensor_parallel_size": 2},
    "node_rank": {"nnodes": 2, "tensor_parallel_size": 2},
}
# Config fields that are deliberately no flag: engine-internal tuning, not a user setting.
NOT_FLAGS = {
    # The share of KV blocks idle sessions may keep pinned: a policy of the engine.
    (CacheConfig, "session_cache_fraction"),
    # Which data-parallel core a config is for: the front sets it for each core it starts.
    (ParallelConfig, "data_parallel_rank"),
    # Grammar compile pool and cache count, and the constraint limits (the cache's byte bound,
    # --structured-outputs-cache-bytes, is a flag).
    *(
        (StructuredOutputsConfig, f.name)
        for f in dataclasses.fields(StructuredOutputsConfig)
        if f.name != "structured_outputs_cache_bytes"
    ),
}


def sections(config_class: type) -> dict[str, type]:
    """The nested config dataclasses of ``config_class`` (field name -> class)."""
    hints = typing.get_type_hints(config_class)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(config_class)
        if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])
    }


def leaves(config: Any) -> dict[tuple[type, str], Any]:
    """Every setting of an ``EngineConfig`` as (config class, field name) -> value (nested
    configs such as ``ConstraintLimits`` are one value of their parent)."""
    out: dict[tuple[type, str], Any] = {}
    nested = sections(EngineConfig)
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if type(config) is EngineConfig and f.name in nested:
            out.update(leaves(value))
        else:
            out[(type(config), f.name)] = value
    return out


def test_values_cover_every_field() -> None:
    assert set(VALUES) == set(FIELDS)
    assert all(getattr(EngineArgs(), n) != VALUES[n] for n in FIELDS)


def test_one_name_for_flag_field_config_field_and_keyword() -> None:
    for name in FIELDS:
        spec = flag_spec(name)
        assert spec.config_field == name, (name, spec.config_field)
        assert flag_of(name) == "--" + name.replace("_", "-")


@pytest.mark.parametrize("name", FIELDS)
def test_every_engine_arg_reaches_exactly_its_config_field(name: str) -> None:
    base = COMPANIONS.get(name, {})
    before = leaves(EngineArgs(**base).create_engine_config())
    after = leaves(EngineArgs(**{**base, name: VALUES[name]}).create_engine_config())
    changed = {key for key in after if after[key] != before[key]}
    spec = flag_spec(name)
    assert changed == {(spec.config, spec.config_field)}
    assert after[(spec.config, spec.config_field)] == VALUES[name]


def test_every_config_user_setting_has_a_flag() -> None:
    declared = {(flag_spec(n).config, flag_spec(n).config_field) for n in FIELDS}
    every = set(leaves(EngineConfig()))
    assert every >= NOT_FLAGS
    assert every - NOT_FLAGS == declared
    assert len(declared) == len(FIELDS)  # no two fields set the same config field


def test_the_config_objects_are_the_engine_configs_sections() -> None:
    """The builder takes the sections from ``EngineConfig`` itself: each declared config class
    is EngineConfig or one of its nested configs."""
    owners = {flag_spec(n).config for n in FIELDS}
    assert owners <= {EngineConfig, *sections(EngineConfig).values()}


def test_structured_outputs_config_is_part_of_engine_config() -> None:
    assert sections(EngineConfig)["structured_outputs"] is StructuredOutputsConfig
    assert EngineArgs().create_engine_config().structured_outputs == StructuredOutputsConfig()


# ---------------------------------------------------------------------- the three renames
@pytest.mark.parametrize(
    ("argv", "section", "field", "value"),
    [
        (["--num-gpu-blocks-override", "64"], "cache", "num_gpu_blocks_override", 64),
        (["--scheduling-policy", "priority"], "scheduler", "scheduling_policy", "priority"),
        (["--kv-cache-memory", "1048576"], "cache", "kv_cache_memory", 1 << 20),
    ],
)
def test_renamed_flags_keep_vllm_spelling_and_one_name(
    argv: list[str], section: str, field: str, value: Any
) -> None:
    args = build_parser().parse_args(["serve", *argv])
    engine_args = EngineArgs.from_cli_args(args)
    assert getattr(engine_args, field) == value
    config = engine_args.create_engine_config()
    assert getattr(getattr(config, section), field) == value
    assert getattr(EngineArgs(**{field: value}).create_engine_config(), section) == getattr(
        config, section
    )


def test_config_classes_take_the_flag_names() -> None:
    assert CacheConfig(num_gpu_blocks_override=8).num_gpu_blocks_override == 8
    assert CacheConfig(kv_cache_memory=1 << 20).kv_cache_memory == 1 << 20
    assert SchedulerConfig(scheduling_policy="priority").scheduling_policy == "priority"
    with pytest.raises(ValueError, match=r"^--scheduling-policy must be"):
        EngineArgs(scheduling_policy="lifo").create_engine_config()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^--num-gpu-blocks-override must be >= 2"):
        EngineArgs(num_gpu_blocks_override=1).create_engine_config()


def test_old_keyword_names_are_gone() -> None:
    """``LLM(**kwargs)`` takes ``EngineArgs`` names only: the old ``kv_cache_memory_bytes``
    is refused as unknown (no alias; the flag was always ``--kv-cache-memory``)."""
    with pytest.raises(TypeError, match="kv_cache_memory_bytes"):
        EngineArgs(kv_cache_memory_bytes=1 << 20)  # type: ignore[call-arg]
