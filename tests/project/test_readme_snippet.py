"""The README's offline ``LLM`` snippet runs as a user runs it: saved as a script in the repo
root and started without ``PYTHONSAFEPATH``, so the repo root is first on ``sys.path``. The
repo's ``kernels/`` folder must not shadow Hugging Face's ``kernels`` package, which
transformers imports (issue 41, item 4)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def readme_llm_snippet() -> str:
    blocks = PYTHON_BLOCK.findall((ROOT / "README.md").read_text())
    found = [b for b in blocks if "LLM(" in b and "generate(" in b]
    assert len(found) == 1, "the README has one offline LLM snippet"
    return str(found[0])


@pytest.mark.slow
def test_readme_llm_snippet_runs_from_repo_root_without_safepath(tmp_path: Path) -> None:
    script = ROOT / f"readme_snippet_{uuid.uuid4().hex[:8]}.py"
    script.write_text(readme_llm_snippet())
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONSAFEPATH", None)
    try:
        result = subprocess.run(
            [sys.executable, script.name],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        script.unlink()
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip(), "the snippet prints the generated text"
    assert "CUDAProperties" not in result.stderr
