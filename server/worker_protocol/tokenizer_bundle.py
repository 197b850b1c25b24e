"""``GetTokenizer``: the served tokenizer as a ZIP bundle streamed in chunks, the SHA-256 of
the whole archive on the last chunk only (smg-grpc-proto's ``GetTokenizerChunk``).

The bundle is what the front's tokenizer *is*, not what a model folder happens to hold: the
tokenizer is saved with ``save_pretrained`` (so a GGUF model's tokenizer, built from the
GGUF, and a ``--chat-template`` override travel too), plus the model folder's
``config.json`` / ``generation_config.json`` when it has them. Built once, off the event loop.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smg_grpc_proto.generated import common_pb2

CHUNK_BYTES = 64 * 1024  # what the gateway's client reads per message
_MODEL_FILES = ("config.json", "generation_config.json")


@dataclass(frozen=True)
class TokenizerBundle:
    data: bytes
    sha256: str

    def chunks(self) -> Iterator[common_pb2.GetTokenizerChunk]:
        for start in range(0, len(self.data), CHUNK_BYTES):
            end = start + CHUNK_BYTES
            last = end >= len(self.data)
            yield common_pb2.GetTokenizerChunk(
                data=self.data[start:end], sha256=self.sha256 if last else ""
            )


def build_bundle(tokenizer: Any, model_path: str | None) -> TokenizerBundle:
    """Zip ``tokenizer`` (a transformers tokenizer) and the model's config files."""
    folder = Path(tempfile.mkdtemp(prefix="tokenwire-tokenizer-"))
    try:
        tokenizer.save_pretrained(str(folder))
        source = Path(model_path) if model_path else None
        if source is not None and source.is_dir():
            for name in _MODEL_FILES:
                if (source / name).is_file() and not (folder / name).exists():
                    shutil.copyfile(source / name, folder / name)
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(folder.iterdir()):
                if path.is_file():
                    archive.write(path, path.name)
        data = buffer.getvalue()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return TokenizerBundle(data, hashlib.sha256(data).hexdigest())
