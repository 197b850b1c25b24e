"""Load a model (weights, architecture, tokenizer, EOS ids) onto a device.

Sources, by ``ModelConfig``:
- ``model=None``: the default SmolLM2-135M-Instruct GGUF (see ``default_model``);
- a Hugging Face hub id ``ORG/NAME`` that is not a local path: its snapshot in the local HF
  cache, downloaded first when the hub is reachable (``--revision``, ``--download-dir``,
  ``HF_HUB_OFFLINE``; see ``hub``), then loaded as the directory (a) or GGUF file it holds;
  served under the id. ``--tokenizer`` takes a hub id the same way;
- a ``.gguf`` file (or ``load_format="gguf"``): converted once into an HF directory in the
  user cache (see ``gguf_convert``), then loaded like (a);
- (a) an HF directory: config.json + one or many ``*.safetensors`` (optionally a
  ``model.safetensors.index.json``), read memory-mapped with safetensors, never through
  transformers' ``from_pretrained``;
- ``load_format="dummy"``: random weights from a config.json (directory or file), or from a
  bundled benchmark config selected by name (``llama-3.2-1b``, ``qwen3-0.6b``,
  ``llama-3.1-8b``; see ``bundled_configs``).

Quantization: ``ModelConfig.quantization`` (``--quantization``) and config.json's
``quantization_config`` pick the weight scheme (``layers.quant.registry``); the decoder's
linear layers load the scheme's tensors (GPTQ / AWQ) or quantize the checkpoint's weights
(int8), then convert them once into the kernels' layouts (``process_weights_after_loading``).

GGUF kept quantized (``--quantization gguf``, ``layers.quant.gguf``): the decoder's linears
load the file's Q4_0/Q4_1 (int4) or Q8_0 (int8) blocks straight from the .gguf (config and
tokenizer still come from the converted directory). On CPU with ``--dtype auto`` an all-int4
GGUF (the default model) runs this way: float32 model, int4 linears on torch's bf16 int4
kernel (measured by ``scripts/gguf_decode_cost.py``); an explicit ``--dtype`` (e.g.
``float32``) without ``--quantization gguf`` loads today's exact de-quantized float weights.

Tensor parallelism: ``load_model(..., tp=group)`` builds this rank's share of the model and
reads only this rank's slices of each safetensors tensor (``iter_safetensors`` yields lazy
``WeightSource``s; each parameter knows its split). Each rank resolves the source itself: a
GGUF conversion publishes its cache directory with an atomic rename, so ranks racing to convert
are safe (converting once before starting the ranks saves the duplicated work).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.front.tokenizer import Tokenizer, load_chat_template, load_tokenizer
from tokenwire.runtime.loader.generation_config import default_sampling
from tokenwire.runtime.loader.hub import resolve_tokenizer_dir
from tokenwire.runtime.loader.kernel_choice import gguf_plan, lm_head_kind, prepare_fused_stack
from tokenwire.runtime.loader.pooling_config import (
    base_decoder_config,
    embed_spec,
    resolve_task,
)
from tokenwire.runtime.loader.source import ModelSource, model_source
from tokenwire.runtime.models.arch import ModelArch, token_id_tuple
from tokenwire.runtime.models.gemma3_mm import build_gemma3_mm
from tokenwire.runtime.models.gemma3_mm_config import gemma3_text_config, is_gemma3_mm
from tokenwire.runtime.models.layers import process_weights_after_loading
from tokenwire.runtime.models.layers.quant.base import QuantConfig
from tokenwire.runtime.models.layers.quant.gguf import GGUFConfig, iter_gguf_checkpoint
from tokenwire.runtime.models.layers.quant.registry import resolve_quant_config
from tokenwire.runtime.models.llama import LlamaForCausalLM, build_model
from tokenwire.runtime.models.llava import build_llava
from tokenwire.runtime.models.llava_config import is_llava, llava_text_config
from tokenwire.runtime.models.qwen_vl import build_qwen_vl
from tokenwire.runtime.models.qwen_vl_config import is_qwen_vl, qwen_vl_text_config
from tokenwire.runtime.models.weights import SafetensorsWeight, WeightSource
from tokenwire.runtime.pooling_params import EmbedSpec

_INDEX_FILE = "model.safetensors.index.json"
_DEFAULT_INIT_STD = 0.02  # HF initializer_range default
_SINGLE = TPGroup.single()  # immutable: the default group of one


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM  # eval mode, on ``device`` in ``dtype``
    arch: ModelArch
    model_path: Path  # HF-format directory (the GGUF cache directory for GGUF sources)
    tokenizer: Tokenizer | None  # None when the directory holds no tokenizer
    # Union of generation_config.json and config.json eos_token_id (see ``_eos_token_ids``).
    eos_token_ids: frozenset[int]
    max_model_len: int
    served_model_name: str
    device: torch.device
    dtype: torch.dtype
    quantization: str | None = None  # the weight scheme ("gptq", "awq", "int8", "gguf")
    tokenizer_dir: Path | None = None  # where ``tokenizer`` was loaded from (a hub snapshot...)
    # Set for an embedding model (``--task embed``): its pooler and Matryoshka sizes.
    embed: EmbedSpec | None = None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``ModelConfig.dtype`` -> torch dtype; "auto" is float32 on CPU, bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def _decoder_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: a vision-language model's language model, else ``config``."""
    if is_llava(config):
        return llava_text_config(config)
    if is_gemma3_mm(config):
        return gemma3_text_config(config)
    return qwen_vl_text_config(config) if is_qwen_vl(config) else config


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPGroup = _SINGLE,
) -> LoadedModel:
    """Build and load the model (this rank's share of it under ``tp``) on ``device``.

    No collectives run here: each rank loads independently. An impossible split raises
    ``ValueError`` naming ``--tensor-parallel-size`` before any weight is read.
    """
    source = model_source(model_config)
    folder = source.folder
    # Settings the front uses, checked here so a bad one is a startup error (before any
    # weight is read); the core hands them to the front in EngineInfo.
    tokenizer_dir = resolve_tokenizer_dir(model_config, folder)
    load_chat_template(model_config.chat_template)
    default_sampling(model_config, folder, source.gguf)
    config = _read_json(source.config_file)
    task = resolve_task(model_config.task, folder, config)
    embed = None
    decoder_config = _decoder_config(config)
    arch = ModelArch.from_hf_config(
        decoder_config if task != "embed" else base_decoder_config(config)
    )
    if task == "embed":  # the LM head is never used: a checkpoint without one loads
        arch = dataclasses.replace(arch, tie_word_embeddings=True)
        embed = embed_spec(folder, config, model_config.pooler_config, arch.hidden_size)
    arch.check_tensor_parallel(tp.world_size)
    dummy = model_config.load_format == "dummy"
    plan = gguf_plan(model_config, source, device, dtype)
    if plan is None:
        quant = resolve_quant_config(model_config.quantization, config, dummy=dummy)
    else:
        quant, dtype = plan
    max_model_len = resolve_max_model_len(model_config.max_model_len, arch)
    model = _build(config, arch, device, dtype, max_model_len, tp, quant)
    _load_weights(model, model_config, source, config, quant, embedding=embed is not None)
    process_weights_after_loading(model)  # quantized layers: into the kernels' layouts
    # The LM head: a row's logits do not depend on the batch (bf16 copy: --lm-head-dtype).
    model.prepare_logits(lm_head_kind(model_config, quant, device))
    if device.type == "cpu" and model_config.cpu_fused_layers:
        prepare_fused_stack(model, quant)
    tokenizer = load_tokenizer(tokenizer_dir)
    return LoadedModel(
        model=model,
        arch=arch,
        model_path=folder,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(folder, arch),
        max_model_len=max_model_len,
        served_model_name=model_config.served_model_name or source.served_name,
        device=device,
        dtype=dtype,
        quantization=None if quant is None else quant.name,
        tokenizer_dir=None if tokenizer is None else tokenizer_dir,
        embed=embed,
    )


def _build(
    config: dict[str, Any],
    arch: ModelArch,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    tp: TPGroup,
    quant: QuantConfig | None,
) -> LlamaForCausalLM:
    """Allocate the model of ``config``'s architecture (a multimodal wrapper or the decoder)."""
    if is_llava(config):
        return build_llava(config, arch, device, dtype, max_model_len, tp, quant)
    if is_gemma3_mm(config):
        return build_gemma3_mm(config, arch, device, dtype, max_model_len, tp, quant)
    if is_qwen_vl(config):
        return build_qwen_vl(config, arch, device, dtype, max_model_len, tp, quant)
    return build_model(arch, device, dtype, max_position=max_model_len, tp=tp, quant=quant)


def _load_weights(
    model: LlamaForCausalLM,
    model_config: ModelConfig,
    source: ModelSource,
    config: dict[str, Any],
    quant: QuantConfig | None,
    embedding: bool,
) -> None:
    """Fill ``model``: random weights (``--load-format dummy``), the GGUF file's blocks kept
    quantized, or the safetensors checkpoint (an embedding one named without ``model.``)."""
    if model_config.load_format == "dummy":
        std = float(config.get("initializer_range") or _DEFAULT_INIT_STD)
        init_dummy_weights(model, model_config.seed, std)
    elif isinstance(quant, GGUFConfig) and source.gguf is not None:
        model.load_weights(iter_gguf_checkpoint(source.gguf, quant.plan))
    else:
        weights = iter_safetensors(source.folder)
        model.load_weights(with_model_prefix(weights) if embedding else weights)


def with_model_prefix(
    weights: Iterator[tuple[str, WeightSource]],
) -> Iterator[tuple[str, WeightSource]]:
    """Embedding checkpoints saved from the bare decoder (``Qwen3Model``, as
    sentence-transformers does) name tensors without HF's ``model.`` prefix: add it."""
    for name, source in weights:
        if name.startswith(("model.", "lm_head.")):
            yield name, source
        else:
            yield f"model.{name}", source


def _read_json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def resolve_max_model_len(requested: int | None, arch: ModelArch) -> int:
    """The context length to serve (default: the model's); errors name ``max_model_len``.

    Sliding-window layers mask by their window in the attention kernels, so a windowed model
    (Mistral, Gemma 2/3, Phi-3) serves its whole context, not just one window.
    """
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's context length "
            f"(max_position_embeddings={limit})"
        )
    return requested


def _eos_token_ids(folder: Path, arch: ModelArch) -> frozenset[int]:
    """Union of generation_config.json and config.json ``eos_token_id``.

    HF ``generate()`` stops on ``generation_config.eos_token_id``; when generation_config.json
    is absent, transformers copies config.json's value, so the union equals HF's set in both
    cases whenever (as in every released checkpoint we know of, e.g. Llama 3 instruct) the
    generation config's list contains the config's id. Taking the union never lets a model
    run past an id either file declares as end-of-sequence.
    """
    ids = set(arch.eos_token_ids)
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        ids.update(token_id_tuple(_read_json(gen_path).get("eos_token_id")))
    return frozenset(ids)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = _read_json(index)["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {folder}")
    return files


def iter_safetensors(folder: Path) -> Iterator[tuple[str, WeightSource]]:
    """Yield (HF name, lazy ``WeightSource``) for every tensor of every shard file.

    Nothing is read until the consumer asks: ``read()`` for the whole tensor or
    ``read_slice(dim, start, length)`` for one rank's part (through safetensors'
    ``get_slice``, memory-mapped). A source is valid until the iteration leaves its file.
    """
    from safetensors import safe_open

    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                yield name, SafetensorsWeight(handle, name)


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int, std: float) -> None:
    """Random weights, deterministic for (seed, device): N(0, std) matrices and biases,
    norm weights 1. With pre-norm blocks and std 0.02 the residual stream stays O(1) per
    layer, so activations remain finite in bfloat16 for deep stacks.

    Under tensor parallelism every rank draws each full (TP=1) tensor from the same seed and
    keeps its slice, so the TP=N dummy model equals the TP=1 one on the same device type
    (one full parameter at a time is the extra memory)."""
    device = model.model.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    model.init_random_weights(generator, std)  # registration order: deterministic
