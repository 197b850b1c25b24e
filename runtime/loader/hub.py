"""Hugging Face hub ids as the model / tokenizer argument (``tokenwire serve ORG/NAME``).

As in vLLM, an argument that is not an existing local path and has the form ``ORG/NAME`` is a
hub repository: ``huggingface_hub.snapshot_download`` finds it in the local HF cache or
downloads it there, and the snapshot folder is then loaded like any local directory.

- cache: ``--download-dir`` (vLLM's name), else ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``~/.cache/huggingface/hub`` -- read when resolving, so a changed environment counts;
- ``--revision`` (``--tokenizer-revision``): a branch, tag or commit (default: ``main``);
- ``HF_HUB_OFFLINE=1``: cache only (``local_files_only``); without it an unreachable hub also
  falls back to the cache (``snapshot_download``'s own behaviour).

Only what loading needs is downloaded: config, tokenizer and generation files, plus
``*.safetensors`` weights unless the weights are dummy. Failures are a ``ValueError`` that names
the argument and says where it looked (no traceback at startup).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tokenwire.runtime.config import ModelConfig

# ORG/NAME, each part as the hub allows (letters, digits, '-', '_', '.'; no '--' or '..').
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_TRUE = ("1", "on", "yes", "true")
# What a model directory is loaded from (weights added unless they are dummy).
CONFIG_PATTERNS = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken")
WEIGHT_PATTERNS = ("*.safetensors",)


def looks_like_hub_id(text: str) -> bool:
    """``ORG/NAME`` (not ``./x``, ``/abs/path``, ``a/b/c`` or ``~/x``)."""
    return bool(_HUB_ID.fullmatch(text)) and ".." not in text and "--" not in text


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` set to a true value (huggingface_hub's own spelling)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_cache_dir(download_dir: str | None) -> Path:
    """Where snapshots are looked up and downloaded (see the module docstring)."""
    if download_dir:
        return Path(download_dir).expanduser()
    explicit = os.environ.get("HF_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def resolve_hub_id(
    repo_id: str,
    *,
    param: str,
    revision: str | None,
    download_dir: str | None,
    patterns: tuple[str, ...] = CONFIG_PATTERNS + WEIGHT_PATTERNS,
) -> Path:
    """The local snapshot folder of ``repo_id`` at ``revision`` (downloaded when the hub is
    reachable and not cached yet). ``param`` names the argument in errors (``model``)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir(download_dir)
    offline = hub_offline()
    where = f"revision {revision or 'main'!r}, cache {cache}"
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=list(patterns),
        )
    except IncompleteSnapshotError as exc:
        raise ValueError(f"{param}: {repo_id!r}: {_first_line(exc)}") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1" if offline else "the hub is unreachable"
        raise ValueError(
            f"{param}: {repo_id!r} does not exist: it is neither a local path nor in the "
            f"Hugging Face cache ({where}; {why})"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as exc:
        raise ValueError(
            f"{param}: {repo_id!r} is neither a local path nor a model on the Hugging Face hub "
            f"({where}): {_first_line(exc)}"
        ) from None
    except (HfHubHTTPError, HFValidationError, OSError) as exc:
        raise ValueError(f"{param}: {repo_id!r} could not be fetched ({where}): {exc}") from None
    return Path(folder)


def resolve_tokenizer_dir(model_config: ModelConfig, model_folder: Path) -> Path:
    """``--tokenizer``: a local directory or a hub id (``--tokenizer-revision``); default:
    the model's own directory ``model_folder``."""
    name = model_config.tokenizer
    if not name:
        return model_folder
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or not looks_like_hub_id(name):
        raise ValueError(
            f"tokenizer: directory {name!r} does not exist (expected a local tokenizer "
            "directory or a Hugging Face hub id ORG/NAME)"
        )
    return resolve_hub_id(
        name,
        param="tokenizer",
        revision=model_config.tokenizer_revision,
        download_dir=model_config.download_dir,
        patterns=CONFIG_PATTERNS,
    )


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
