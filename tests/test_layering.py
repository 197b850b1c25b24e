"""The import rules of DESIGN §2, checked on the source (every ``import``, including ones
inside functions): runtime and kernels import no server stack; the server reaches the runtime
only through the engine-client seam; the REST shim imports no runtime at all."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVER_STACK = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "grpc_status",
    "google.rpc",
    "fastapi",
    "starlette",
    "uvicorn",
    "structlog",
    "opentelemetry",
    "prometheus_client",
    "tokenwire.server",
    "tokenwire.clients",
    "tokenwire.bench",
    "tokenwire.v1",
)
# What the server may use of the runtime: the engine-client seam and the plain records,
# parameters and errors that cross it, plus front-side text tools.
SEAM = (
    "tokenwire.runtime.engine.protocol",
    "tokenwire.runtime.engine.async_engine",
    "tokenwire.runtime.engine.request_stream",
    "tokenwire.runtime.config",
    "tokenwire.runtime.engine_args",
    "tokenwire.runtime.errors",
    "tokenwire.runtime.sampling_params",
    "tokenwire.runtime.outputs",
    "tokenwire.runtime.output_processor",
    "tokenwire.runtime.request",
    "tokenwire.runtime.stats",
    "tokenwire.runtime.tokenizer",
    "tokenwire.runtime.tokenizer_pool",
    "tokenwire.runtime.tool_parsers",  # front-side text tools: tool calls, reasoning
    "tokenwire.runtime.lora.request",  # the plain record naming an adapter
)
# ``tokenwire generate`` is the offline LLM on the command line; ``tokenwire worker`` runs a
# node's tensor-parallel ranks.
OFFLINE_CLI = {"server/cli.py": ("tokenwire.runtime.llm", "tokenwire.runtime.executor.node")}


def imports_of(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def sources(folder: str) -> list[Path]:
    found = sorted((REPO / folder).rglob("*.py"))
    assert found, folder
    return found


@pytest.mark.parametrize("folder", ["runtime", "kernels"])
def test_runtime_and_kernels_import_no_server_stack(folder: str) -> None:
    bad = {
        str(path.relative_to(REPO)): [n for n in imports_of(path) if _under(n, SERVER_STACK)]
        for path in sources(folder)
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_kernels_import_no_runtime() -> None:
    bad = [
        (str(p.relative_to(REPO)), n)
        for p in sources("kernels")
        for n in imports_of(p)
        if _under(n, ("tokenwire.runtime",))
    ]
    assert bad == []


def test_server_reaches_the_runtime_only_through_the_seam() -> None:
    bad = []
    for path in sources("server"):
        rel = str(path.relative_to(REPO))
        allowed = SEAM + OFFLINE_CLI.get(rel, ())
        for name in imports_of(path):
            if not _under(name, ("tokenwire.runtime",)):
                continue
            # ``from tokenwire.runtime.engine import x`` lists the package and the member.
            if _under(name, allowed) or any(a.startswith(name + ".") for a in allowed):
                continue
            bad.append((rel, name))
    assert bad == []


ENGINE_INTERNALS = {"core", "scheduler", "kv_cache_manager", "loaded", "runner", "client"}


def test_server_never_reaches_into_the_engine() -> None:
    """No attribute path through the engine client to its core, scheduler, KV cache manager,
    loaded model or core client: the server reads ``info`` and ``stats_snapshot()``."""
    bad = []
    for path in sources("server"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
                bad.append((str(path.relative_to(REPO)), node.lineno, node.attr))
    assert bad == []


def test_rest_shim_imports_no_runtime() -> None:
    bad = [
        (str(p.relative_to(REPO)), n)
        for p in sources("server/rest")
        for n in imports_of(p)
        if _under(n, ("tokenwire.runtime", "torch", "transformers", "tokenwire.server.grpc"))
    ]
    assert bad == []


def test_client_library_stands_alone() -> None:
    """clients/ is the gRPC client library: protos only, no runtime, server or bench."""
    bad = [
        (str(p.relative_to(REPO)), n)
        for p in sources("clients")
        for n in imports_of(p)
        if _under(n, ("tokenwire.runtime", "tokenwire.server", "tokenwire.bench", "torch"))
    ]
    assert bad == []


def test_the_rules_see_function_level_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import grpc\n    from tokenwire.runtime.engine import core\n")
    assert imports_of(probe) == [
        "grpc",
        "tokenwire.runtime.engine",
        "tokenwire.runtime.engine.core",
    ]
