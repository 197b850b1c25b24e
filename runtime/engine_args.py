"""One definition of every engine flag (vLLM's ``EngineArgs``).

``EngineArgs`` is a frozen dataclass with one field per engine setting. Each field is declared
once, here or in the flag group it belongs to (``engine_args_model``: the model's flags;
``engine_args_batch``: batching and the KV cache): its command-line flag, type, choices and
help text (``engine_args_spec.arg``); its default is read from the field of the config
dataclass that holds it (``runtime/config.py``), so there is no second copy of a default.
``tokenwire serve``, ``generate``, ``bench throughput``, ``bench overhead`` and
``LLM(**kwargs)`` all go through it, so every flag works everywhere with the same name:

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    config = EngineArgs.from_cli_args(parser.parse_args()).create_engine_config()

Each field names the config dataclass and field it sets (its ``FlagSpec``), under one name:
the field ``num_gpu_blocks_override`` is the flag ``--num-gpu-blocks-override``, the keyword
``LLM(num_gpu_blocks_override=...)`` and ``CacheConfig.num_gpu_blocks_override``.
``create_engine_config`` builds the config objects from those declarations alone (the few
values converted on the way in: ``TO_CONFIG``). Validation stays in the config dataclasses;
``create_engine_config`` re-raises their ``ValueError`` with the config field replaced by the
flag to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenwire.runtime.config import (
    EngineConfig,
    LoRAConfig,
    ParallelConfig,
    SpeculativeConfig,
)
from tokenwire.runtime.engine_args_batch import BatchArgs
from tokenwire.runtime.engine_args_model import ModelArgs
from tokenwire.runtime.engine_args_spec import FlagSpec, arg
from tokenwire.runtime.flag_values import (
    LoRAModulesAction,
    max_model_len_from_value,
    parse_lora_module,
    parse_speculative_config,
    speculative_from_value,
)
from tokenwire.runtime.kv_events_config import (
    KVEventsConfig,
    kv_events_from_value,
    parse_kv_events_config,
)
from tokenwire.runtime.pooling_params import (
    pooler_from_value,
)
from tokenwire.runtime.structured.config import StructuredOutputsConfig


@dataclass(frozen=True)
class EngineArgs(BatchArgs, ModelArgs):
    """Every engine setting, with the defaults of the config dataclasses: the model's
    (``ModelArgs``), batching and the KV cache (``BatchArgs``), and here the device,
    parallelism, LoRA, speculative decoding, KV events and the grammar cache."""

    device: str = arg(EngineConfig, "device", "auto, cpu, cuda or cuda:N", type=str)
    tensor_parallel_size: int = arg(
        ParallelConfig,
        "tensor_parallel_size",
        "ranks (processes, one device each) to shard the model over",
        type=int,
    )
    data_parallel_size: int = arg(
        ParallelConfig,
        "data_parallel_size",
        "engine cores behind one front, each with the whole model (its own GPU on CUDA, its "
        "share of the cores on CPU); requests are balanced by load with prefix and Session "
        "affinity",
        type=int,
    )
    distributed_init_method: str | None = arg(
        ParallelConfig,
        "distributed_init_method",
        "tensor parallelism rendezvous: tcp://HOST:PORT or env:// (torchrun's MASTER_ADDR / "
        "MASTER_PORT); default: --master-addr/--master-port with several nodes, else a free "
        "loopback port",
        type=str,
    )
    nnodes: int = arg(
        ParallelConfig, "nnodes", "nodes the tensor-parallel ranks are spread over", type=int
    )
    node_rank: int = arg(
        ParallelConfig,
        "node_rank",
        "this node's index (0 runs the server; others run `tokenwire worker`)",
        type=int,
    )
    master_addr: str = arg(
        ParallelConfig, "master_addr", "node 0's address for the rendezvous", type=str
    )
    master_port: int = arg(ParallelConfig, "master_port", "rendezvous TCP port", type=int)
    distributed_timeout: float = arg(
        ParallelConfig,
        "distributed_timeout",
        "seconds a collective waits on a silent rank before the engine is declared dead",
        type=float,
    )
    distributed_startup_timeout: float = arg(
        ParallelConfig,
        "distributed_startup_timeout",
        "seconds the ranks may take to meet and load the model",
        type=float,
    )
    enforce_eager: bool = arg(
        EngineConfig,
        "enforce_eager",
        "CUDA: run every step eagerly (no decode CUDA graphs)",
        action="store_true",
    )
    cpu_compile: bool = arg(
        EngineConfig,
        "cpu_compile",
        "CPU: compile the model's forward with torch.compile (inductor) at startup; attention "
        "stays eager (docs/benchmarks.md#compiled-cpu-forward---cpu-compile)",
        action=argparse.BooleanOptionalAction,
    )

    enable_lora: bool = arg(
        LoRAConfig,
        "enable_lora",
        "serve LoRA adapters (PEFT format) on the base model, chosen per request by `model`",
        action="store_true",
    )
    lora_modules: tuple[tuple[str, str], ...] = arg(
        LoRAConfig,
        "lora_modules",
        "adapters loaded at startup, as NAME=PATH (PATH: a PEFT adapter directory)",
        type=parse_lora_module,
        action=LoRAModulesAction,
        metavar="NAME=PATH",
    )
    max_loras: int = arg(
        LoRAConfig, "max_loras", "LoRA adapters resident on the device at once", type=int
    )
    max_lora_rank: int = arg(LoRAConfig, "max_lora_rank", "largest adapter rank", type=int)
    max_cpu_loras: int | None = arg(
        LoRAConfig,
        "max_cpu_loras",
        "LoRA adapters kept in CPU memory per worker (default: --max-loras)",
        type=int,
    )
    speculative_config: SpeculativeConfig | None = arg(  # noqa: RUF009 (a frozen config)
        EngineConfig,
        "speculative_config",
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5, "disable_by_batch_size": N} or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}',
        type=parse_speculative_config,
        metavar="JSON",
    )
    kv_events_config: KVEventsConfig | None = arg(  # noqa: RUF009 (a frozen config)
        EngineConfig,
        "kv_events_config",
        'KV-cache events, vLLM\'s JSON: {"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "buffer_steps": N, '
        '"hwm": N, "topic": ""} (docs/fleet.md)',
        type=parse_kv_events_config,
        metavar="JSON",
    )
    structured_outputs_cache_bytes: int = arg(
        StructuredOutputsConfig,
        "structured_outputs_cache_bytes",
        "compiled grammars the engine core keeps (least recently used dropped first), in "
        "bytes; also the most one grammar may compile to (a larger one: INVALID_ARGUMENT)",
        type=int,
        metavar="BYTES",
    )

    # ------------------------------------------------------------------ command line
    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser,
        *,
        model_positional: bool = True,
        model_help: str | None = None,
    ) -> argparse.ArgumentParser:
        """Add every engine flag to ``parser``. The model is the optional positional ``MODEL``
        (``serve``, ``bench``) or ``--model`` where a positional means something else
        (``generate``'s prompt); ``model_help`` replaces its help text."""
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(EngineArgs):
            spec = flag_spec(f.name)
            kwargs: dict[str, Any] = {"default": f.default, "help": _help(spec, f.default)}
            if spec.action is not None:
                kwargs["action"] = spec.action
            if spec.type is not None:
                kwargs["type"] = spec.type
            if spec.choices is not None:
                kwargs["choices"] = spec.choices
            if spec.metavar is not None:
                kwargs["metavar"] = spec.metavar
            if f.name == "model" and model_help is not None:
                kwargs["help"] = model_help
            if f.name == "model" and model_positional:
                group.add_argument("model", nargs="?", metavar="MODEL", **kwargs)
            else:
                group.add_argument(flag_of(f.name), dest=f.name, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    # ------------------------------------------------------------------ config
    def create_engine_config(self) -> EngineConfig:
        """The frozen ``EngineConfig``, built from each field's declared config field (its
        ``FlagSpec``): the sections (``ModelConfig``, ``CacheConfig``, ...) get their fields'
        values, ``EngineConfig`` the rest; a section no field names keeps its defaults. A bad
        value raises a ``ValueError`` naming its flag."""
        values: dict[type, dict[str, Any]] = {}
        try:
            for f in dataclasses.fields(self):
                spec = flag_spec(f.name)
                value = getattr(self, f.name)
                convert = TO_CONFIG.get(f.name)
                values.setdefault(spec.config, {})[spec.config_field] = (
                    value if convert is None else convert(value)
                )
            sections = {
                name: config(**values.get(config, {})) for name, config in config_sections().items()
            }
            return EngineConfig(**sections, **values.get(EngineConfig, {}))
        except ValueError as exc:
            raise ValueError(name_flags(str(exc))) from None


# The one place where an ``EngineArgs`` value is not its config field's value as it is: what
# ``LLM(**kwargs)`` may pass in another form than the flag's parsed one.
TO_CONFIG: dict[str, Callable[[Any], Any]] = {
    "max_model_len": max_model_len_from_value,  # LLM(max_model_len="8k")
    "speculative_config": speculative_from_value,  # vLLM's dict, or the flag's JSON text
    "kv_events_config": kv_events_from_value,
    "lora_modules": tuple,  # LLM(lora_modules=[("name", "/path")])
    "pooler_config": pooler_from_value,  # LLM(pooler_config={"pooling_type": "MEAN"})
}


def config_sections() -> dict[str, type]:
    """``EngineConfig``'s fields that are config dataclasses (``model`` -> ``ModelConfig``)."""
    hints = typing.get_type_hints(EngineConfig)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(EngineConfig)
        if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])
    }


def flag_spec(name: str) -> FlagSpec:
    """The declaration of ``EngineArgs`` field ``name``."""
    for f in dataclasses.fields(EngineArgs):
        if f.name == name:
            spec: FlagSpec = f.metadata["flag"]
            return spec
    raise KeyError(name)


def flag_of(name: str) -> str:
    """The command-line flag of ``EngineArgs`` field ``name`` (``--max-model-len``)."""
    flag_spec(name)  # KeyError for a name that is no field
    return "--" + name.replace("_", "-")


def engine_flags() -> tuple[str, ...]:
    """Every engine option string (``--[no-]`` forms included; the model's is ``--model``)."""
    flags: list[str] = []
    for f in dataclasses.fields(EngineArgs):
        flag = flag_of(f.name)
        flags.append(flag)
        if flag_spec(f.name).action is argparse.BooleanOptionalAction:
            flags.append("--no-" + flag.removeprefix("--"))
    return tuple(flags)


def _help(spec: FlagSpec, default: Any) -> str:
    if spec.action is not None or default is None:
        return spec.help
    return f"{spec.help} (default: {default})"


def _config_flags() -> dict[str, str]:
    """Config field name -> the flag that sets it."""
    return {flag_spec(f.name).config_field: flag_of(f.name) for f in dataclasses.fields(EngineArgs)}


def name_flags(message: str) -> str:
    """A config error message with config field names replaced by their flags.

    The leading word is the field at fault (``block_size must be ...``); other snake_case
    field names later in the message (``... >= max_model_len``) are replaced too. Single
    words (``device``, ``seed``) are only replaced in the lead, where they cannot be prose.
    """
    flags = _config_flags()
    head, sep, rest = message.partition(" ")
    if head in flags:
        head = flags[head]
    for name in flags:
        if "_" in name:
            rest = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", flags[name], rest)
    return head + sep + rest
