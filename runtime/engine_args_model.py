"""The model's engine flags (``ModelArgs``, the ``ModelConfig`` fields of ``EngineArgs``): what
is loaded and from where, its tokenizer and chat template, default sampling, the task, dtypes
and kernels, the context length and the weight scheme. Declared once, here (``engine_args``
explains the declarations).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import get_args

from tokenwire.runtime.config import (
    CpuQuantKernel,
    DType,
    LMHeadDType,
    LoadFormat,
    ModelConfig,
    QuantizationMethod,
)
from tokenwire.runtime.engine_args_spec import arg
from tokenwire.runtime.flag_values import parse_max_model_len
from tokenwire.runtime.pooling_params import TASKS, PoolerConfig, Task, parse_pooler_config


@dataclass(frozen=True)
class ModelArgs:
    """The ``ModelConfig`` settings of ``EngineArgs``, with that config's defaults."""

    model: str | None = arg(
        ModelConfig,
        "model",
        "HF directory, .gguf file, or config dir / bundled config name with "
        "--load-format dummy (default: the embedded SmolLM2-135M-Instruct)",
    )
    tokenizer: str | None = arg(
        ModelConfig,
        "tokenizer",
        "tokenizer directory or Hugging Face hub id ORG/NAME (default: the model's own)",
        type=str,
    )
    revision: str | None = arg(
        ModelConfig,
        "revision",
        "hub model id: the branch, tag or commit to load (default: main)",
        type=str,
    )
    tokenizer_revision: str | None = arg(
        ModelConfig,
        "tokenizer_revision",
        "hub tokenizer id: the branch, tag or commit to load (default: main)",
        type=str,
    )
    download_dir: str | None = arg(
        ModelConfig,
        "download_dir",
        "Hugging Face cache directory for hub ids (default: $HF_HUB_CACHE, else "
        "$HF_HOME/hub, else ~/.cache/huggingface/hub); HF_HUB_OFFLINE=1: cache only",
        type=str,
    )
    served_model_name: str | None = arg(
        ModelConfig,
        "served_model_name",
        "name clients use in `model` (default: the model directory or file name)",
        type=str,
    )
    chat_template: str | None = arg(
        ModelConfig,
        "chat_template",
        "Jinja chat template file, or the template itself inline, replacing the tokenizer's "
        "for chat input (gRPC chat, OpenAI chat/completions, `tokenwire chat`, LLM.chat)",
        type=str,
    )
    generation_config: str = arg(
        ModelConfig,
        "generation_config",
        "default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) of requests that leave them unset: auto = the model's "
        "generation_config.json (the default model: temperature 0 only), vllm = none "
        "(temperature 1.0, top_p 1.0, ...), or a folder holding a generation_config.json; "
        "a request with a structured output or a required / named tool choice gets no "
        "default repetition_penalty",
        type=str,
    )
    allow_content_special_tokens: bool = arg(
        ModelConfig,
        "allow_content_special_tokens",
        "parse special-token text (such as <|im_start|>) inside user and tool message content "
        "as the special tokens themselves, as before; this lets a client forge chat turns "
        "(default: such text is plain text; system and assistant messages are unaffected)",
        action="store_true",
    )
    task: Task = arg(  # noqa: RUF009 (returns an immutable str)
        ModelConfig,
        "task",
        "what the model serves: generate (text), embed (embeddings: EmbeddingService.Embed, "
        "POST /v1/embeddings, LLM.embed), score (text-pair scores of a cross-encoder: "
        "EmbeddingService.Score, POST /v1/score, /v1/rerank, LLM.score), or auto = score for "
        "Bert/XLMRobertaForSequenceClassification, embed for other BERT-family encoders and for "
        "directories with a sentence-transformers pooling module, else generate",
        choices=TASKS,
    )
    pooler_config: PoolerConfig | None = arg(  # noqa: RUF009 (a frozen dataclass or None)
        ModelConfig,
        "pooler_config",
        'embedding models: JSON {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true} '
        "overriding the model's sentence-transformers pooling (default there: LAST + "
        "normalize for decoders, CLS + normalize for encoders)",
        type=parse_pooler_config,
        metavar="JSON",
    )
    dtype: DType = arg(  # noqa: RUF009 (returns an immutable str)
        ModelConfig,
        "dtype",
        "weights and activations: auto = float32 on CPU, bfloat16 on CUDA (a .gguf on CPU: "
        "its Q4 linears kept quantized, bf16 matmuls; an explicit float32 loads it "
        "de-quantized, exact)",
        choices=get_args(DType),
    )
    lm_head_dtype: LMHeadDType = arg(  # noqa: RUF009 (returns an immutable str)
        ModelConfig,
        "lm_head_dtype",
        "CPU LM head weights: auto = int8 (with --cpu-quant-kernel vnni in effect) or bfloat16 "
        "for a .gguf kept quantized (--dtype auto), else float32; bfloat16 / int8 stream a "
        "bf16 copy (half the bytes) / int8 codes per 32-block (a quarter, AVX-512 VNNI) and "
        "recompute each row's top 16 logits in float32; float32 = exact",
        choices=get_args(LMHeadDType),
    )
    cpu_quant_kernel: CpuQuantKernel = arg(  # noqa: RUF009 (returns an immutable str)
        ModelConfig,
        "cpu_quant_kernel",
        "CPU kernel for a .gguf kept quantized: auto = vnni where the CPU has AVX-512 VNNI "
        "and a C compiler builds it, else torch; vnni = int8 activations x int4 codes in "
        "integer dot products (as llama.cpp; not exact), an error where unavailable; torch = "
        "torch's int4 kernel (bf16 activations)",
        choices=get_args(CpuQuantKernel),
    )
    cpu_fused_layers: bool = arg(
        ModelConfig,
        "cpu_fused_layers",
        "on CPU, run a model whose linears all take the VNNI kernel as one decoder-stack "
        "operator (norms, rotary, paged attention and SwiGLU in C) where its layers allow it",
        action=argparse.BooleanOptionalAction,
    )
    max_model_len: int | str | None = arg(
        ModelConfig,
        "max_model_len",
        "context length: an integer, 8k (= 8000), 8K (= 8192), 1m, 1M (vLLM's forms), or "
        "auto (default: the model's own)",
        type=parse_max_model_len,
    )
    load_format: LoadFormat = arg(  # noqa: RUF009 (returns an immutable str)
        ModelConfig,
        "load_format",
        "weights: auto, safetensors, gguf, or dummy (random weights from a config)",
        choices=get_args(LoadFormat),
    )
    seed: int = arg(ModelConfig, "seed", "seed of dummy weights and of unseeded sampling", type=int)
    quantization: QuantizationMethod | None = arg(  # noqa: RUF009 (an immutable str)
        ModelConfig,
        "quantization",
        "weight scheme: fp8 (fp8 e4m3 checkpoints: compressed-tensors or HF fp8; or "
        "quantize an unquantized checkpoint at load: per-channel fp8 weights), "
        "gptq or awq (checkpoints in that format), int8 (quantize an "
        "unquantized checkpoint at load: per-channel int8 weights), gguf (a .gguf's "
        "Q4_0/Q4_1/Q8_0 linears kept quantized, matmuls in --dtype); default: detected from "
        "config.json quantization_config",
        choices=get_args(QuantizationMethod),
    )
