"""Packaging: every source module imports as ``tokenwire.<pkg>.<mod>``, every subpackage is
listed in pyproject (an unlisted one is silently dropped from the wheel), and ``kernels``
never resolves into this repository (HF ships a real package of that name)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {
    "runtime": "tokenwire.runtime",
    "kernels": "tokenwire.kernels",
    "server": "tokenwire.server",
    "clients": "tokenwire.clients",
    "bench": "tokenwire.bench",
}


def source_modules() -> list[tuple[str, Path]]:
    found = []
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found.append((".".join([package, *parts]), path))
    return found


@pytest.mark.parametrize(("name", "path"), source_modules(), ids=lambda v: str(v))
def test_module_imports_under_tokenwire(name: str, path: Path) -> None:
    module = importlib.import_module(name)
    assert module.__file__ is not None
    assert Path(module.__file__).resolve() == path.resolve()


def test_every_subpackage_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            name = ".".join([package, *rel])
            assert name in listed, f"{name} missing from [tool.setuptools] packages"
            assert mapping[name] == "/".join([folder, *rel])
    assert not (ROOT / "tokenwire" / "__init__.py").exists()  # implicit namespace


def _find_spec_from_root(name: str, *, safe_path: bool) -> str:
    """Where ``import <name>`` resolves in a fresh interpreter started in the repo root."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.find_spec({name!r})\n"
        "print(spec.origin if spec and spec.origin else (list(spec.submodule_search_locations)"
        " if spec else 'none'))\n"
    )
    env = dict(os.environ)
    env.pop("PYTHONSAFEPATH", None)
    if safe_path:
        env["PYTHONSAFEPATH"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def _inside(found: str, folder: Path) -> bool:
    return str(folder.resolve()) in found


@pytest.mark.parametrize("safe_path", [True, False], ids=["safepath", "no-safepath"])
def test_top_level_kernels_never_resolves_into_repo(safe_path: bool) -> None:
    """HF's ``kernels`` may live under the repo root (the venv is ``.venv/``): the check is
    against the repo's own ``kernels/`` folder. Without ``PYTHONSAFEPATH`` the repo root is on
    ``sys.path`` first; ``kernels/`` has no ``__init__.py``, so it is only a PEP 420 namespace
    portion and an installed regular ``kernels`` package later on the path wins over it."""
    found = _find_spec_from_root("kernels", safe_path=safe_path)
    if importlib.util.find_spec("kernels") is not None:  # HF's package is installed
        assert not _inside(found, ROOT / "kernels"), found
    assert not (ROOT / "kernels" / "__init__.py").exists()
    for name in ("runtime", "server", "clients", "bench"):
        spec = importlib.util.find_spec(name)
        assert spec is None or not _inside(str(spec.origin), ROOT / name), name


def test_no_dependency_is_listed_twice() -> None:
    """A requirement named twice in one list is a copy-paste slip that drifts apart later."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lists = {"dependencies": project.get("dependencies", [])}
    lists.update(project.get("optional-dependencies", {}))
    for group, requirements in lists.items():
        names = [re.split(r"[\s\[;=<>!~]", r.strip(), maxsplit=1)[0].lower() for r in requirements]
        twice = sorted({n for n in names if names.count(n) > 1})
        assert not twice, f"{group} lists {twice} more than once"
