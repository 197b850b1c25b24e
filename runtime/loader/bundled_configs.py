"""Bundled config.json files for the benchmark shapes, selectable by name with ``dummy`` weights.

``--load-format dummy`` builds random weights from a config.json, so a GPU benchmark needs no
model hub: ``tokenwire bench throughput llama-3.2-1b --load-format dummy``. The files under
``model_configs/<name>/config.json`` are copies of the published Hugging Face configs (Phi-3's
without its ``auto_map`` / ``_name_or_path``: transformers has the architecture built in) and
ship as package data. DeepSeek-V2-Lite's and gpt-oss-20b's were written from the published
config.json files' numbers (no hub access here; ``model_configs/README.md``): DeepSeek's
without ``auto_map``, gpt-oss's without ``quantization_config`` (dummy experts are bf16,
as the loader's de-quantized MXFP4 experts are). A dummy model has no tokenizer: it takes
token-id prompts only.
"""

from __future__ import annotations

from pathlib import Path

_CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"

# Canonical name -> Hugging Face repository the config.json was copied from.
BUNDLED_CONFIGS: dict[str, str] = {
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "gemma-2-2b": "google/gemma-2-2b",
    "phi-3-mini-4k": "microsoft/Phi-3-mini-4k-instruct",
    # Mixture of experts: ~93 GB (Mixtral) / ~61 GB (Qwen3-MoE) of bf16 weights, one H200.
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    # MLA + DeepSeekMoE (~31 GB bf16) and gpt-oss (~42 GB bf16: MXFP4 experts de-quantized).
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    # Vision-language (issue 33): serve it from a folder with this config.json and an image
    # processor's preprocessor_config.json (``scripts/gpu_check_vlm.py`` writes one).
    "qwen2.5-vl-3b": "Qwen/Qwen2.5-VL-3B-Instruct",
}


def canonical_name(name: str) -> str | None:
    """The bundled name for ``name`` (case-insensitive; HF repo ids accepted), else None."""
    key = name.strip().lower()
    for canonical, repo in BUNDLED_CONFIGS.items():
        if key in (canonical, repo.lower(), repo.split("/")[1].lower()):
            return canonical
    return None


def bundled_config_path(name: str) -> Path | None:
    """Path of the bundled config.json for ``name``; None when ``name`` is not bundled."""
    canonical = canonical_name(name)
    if canonical is None:
        return None
    path = _CONFIG_DIR / canonical / "config.json"
    if not path.is_file():  # a wheel built without package data
        raise FileNotFoundError(f"bundled config {path} is missing from the installation")
    return path
