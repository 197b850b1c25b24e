"""The import rules of docs/architecture.md, checked in the source (every ``import``, including ones
inside functions): runtime and kernels import no server stack; kernels import no runtime; the
server reaches the runtime only through the engine-client seam; the REST shim imports no
runtime at all; ``runtime/core/`` and the plain records at the runtime root reach neither
torch nor the kernels nor the worker (checked by importing them in a fresh interpreter); the
worker, the sampler and the models never import the scheduler side, and nothing below the
model runner imports it; runtime/ has no import circles outside ``TYPE_CHECKING`` blocks, and
through them only the listed, justified ones (``TYPING_CIRCLES``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVER_STACK = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "grpc_status",
    "smg_grpc_proto",  # the gateway worker protocol lives in server/worker_protocol
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
# What the server may use of the runtime: the engine-client seam (protocol and the async
# engine's construction), config and engine args, the plain records that cross it
# (parameters, outputs, errors, stats, the LoRA request record) and the front's text side.
SEAM = (
    "tokenwire.runtime.engine.protocol",
    "tokenwire.runtime.engine.async_engine",
    "tokenwire.runtime.config",
    "tokenwire.runtime.engine_args",
    "tokenwire.runtime.sampling_params",
    "tokenwire.runtime.outputs",
    "tokenwire.runtime.errors",
    "tokenwire.runtime.stats",
    "tokenwire.runtime.lora.request",
    "tokenwire.runtime.front",
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


# --- runtime by role (runtime/core, worker, sample, front; plain records at the root) ---

PLAIN_RECORDS = (
    "config",
    "config_checks",
    "parallel_config",
    "speculative_config",
    "engine_args",
    "engine_args_batch",
    "engine_args_model",
    "engine_args_spec",
    "errors",
    "model_facts",
    "model_output",
    "multimodal",
    "outputs",
    "sampling_params",
    "scheduler_output",
    "stats",
)
HEAVY = ("torch", "tokenwire.kernels", "tokenwire.runtime.worker", "transformers")


def _module_of(path: Path) -> str:
    rel = path.relative_to(REPO / "runtime").with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["tokenwire.runtime", *parts])


def test_core_and_plain_records_import_no_torch_kernels_or_worker() -> None:
    """Imported in a fresh interpreter, the scheduler side and the records that cross seams
    load neither torch nor the kernels nor the worker (what the engine core's bookkeeping and
    a torch-free front need)."""
    core = [_module_of(p) for p in sources("runtime/core")]
    modules = core + [f"tokenwire.runtime.{name}" for name in PLAIN_RECORDS]
    probe = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print([h for h in {HEAVY!r} if h in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


# The model facts read from a config.json (shapes, families, MoE and MLA specs): torch-free,
# so a front or a sizing tool can read them without the device stack.
MODEL_FACTS = ("arch", "hf_config", "moe_config", "llama4_config", "deepseek_config")


def test_model_facts_import_no_torch() -> None:
    modules = [f"tokenwire.runtime.models.{name}" for name in MODEL_FACTS]
    probe = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print([h for h in {HEAVY!r} if h in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def _static_imports(folder: str, forbidden: tuple[str, ...]) -> list[tuple[str, str]]:
    return [
        (str(p.relative_to(REPO)), n)
        for p in sources(folder)
        for n in imports_of(p)
        if _under(n, forbidden)
    ]


def test_core_names_no_torch_kernels_or_worker() -> None:
    """Not even inside a function: the engine core's bookkeeping never reaches the device."""
    forbidden = ("torch", "tokenwire.kernels", "tokenwire.runtime.worker")
    assert _static_imports("runtime/core", forbidden) == []


@pytest.mark.parametrize("folder", ["runtime/worker", "runtime/sample", "runtime/models"])
def test_the_device_side_imports_no_scheduler(folder: str) -> None:
    assert _static_imports(folder, ("tokenwire.runtime.core",)) == []


@pytest.mark.parametrize(
    "folder", ["runtime/sample", "runtime/worker/spec", "runtime/models", "runtime/lora"]
)
def test_nothing_below_the_runner_imports_it(folder: str) -> None:
    """Calls go downward: the sampler, the speculative verify step and draft model, the
    models and the LoRA layers get explicit inputs, never the runner."""
    assert _static_imports(folder, ("tokenwire.runtime.worker.model_runner",)) == []


def _runtime_graph(typing_too: bool = False) -> dict[str, set[str]]:
    """Module -> runtime modules it imports anywhere except under ``if TYPE_CHECKING``
    (``typing_too``: those as well)."""
    modules = {_module_of(p): p for p in sources("runtime")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
            if not typing_too
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[name].update(m for m in found if m in modules and m != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_runtime_has_no_import_circles() -> None:
    """Function-level imports count too; only ``TYPE_CHECKING`` imports (annotations) may
    point back up."""
    assert _cycles(_runtime_graph()) == []


# Circles closed only by ``if TYPE_CHECKING`` imports that stay, each with its reason.
TYPING_CIRCLES: dict[tuple[str, ...], str] = {}


def test_runtime_has_no_import_circles_counting_type_checking_imports() -> None:
    """Annotations name modules too: a circle through them still ties the modules together
    (one cannot be understood, moved or tested without the other)."""
    found = sorted(tuple(c) for c in _cycles(_runtime_graph(typing_too=True)))
    assert found == sorted(TYPING_CIRCLES)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_shared_constants_agree() -> None:
    """Constants the kernels and the torch-free runtime both define (kernels import nothing
    of the runtime, and the scheduler side imports no kernels)."""
    from tokenwire.kernels.activation import GATED_ACTIVATIONS
    from tokenwire.kernels.kv_layout import NULL_BLOCK_ID
    from tokenwire.runtime.models import hf_config
    from tokenwire.runtime.scheduler_output import NULL_BLOCK_ID as RUNTIME_NULL_BLOCK_ID

    assert RUNTIME_NULL_BLOCK_ID == NULL_BLOCK_ID
    assert hf_config.GATED_ACTIVATIONS == GATED_ACTIVATIONS


def test_the_image_byte_limit_agrees() -> None:
    """``tokenwire rest``'s fetch cap (the shim imports nothing of the gRPC server) defaults to
    the gRPC server's ``--max-image-bytes``."""
    from tokenwire.server.grpc.images import ImageLimits
    from tokenwire.server.rest.media_fetch import MediaFetchPolicy

    assert MediaFetchPolicy.max_bytes == ImageLimits.max_bytes
