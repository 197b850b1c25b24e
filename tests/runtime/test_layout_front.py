"""One front pipeline (layout issue 27, item 3): ``AsyncEngine`` and the offline ``LLM`` each
hold a ``Frontend`` (runtime/front/frontend.py) that owns the tokenizer, chat rendering,
output processing, request and structured-output checks and ``n > 1`` fan-out. ``LLM`` loads
its tokenizer from the engine's published ``EngineInfo``, as the served front does, never
from the executor; the server runs the Frontend's tokenization on its pool, off the loop."""

from __future__ import annotations

import ast
import asyncio
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from server_harness import ServerHarness

import tokenwire.runtime.loader.model_loader as model_loader
from tokenwire.runtime.engine.async_engine import AsyncEngine
from tokenwire.runtime.engine.core_loop import engine_info
from tokenwire.runtime.front.frontend import Frontend
from tokenwire.runtime.front.tokenizer import Tokenizer, apply_chat_template, load_tokenizer
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "Hi there"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# What the Frontend composes; the two fronts hold a Frontend instead of composing them.
FRONT_PARTS = (
    "OutputProcessor",
    "StructuredValidator",
    "load_tokenizer",
    "apply_chat_template",
    "validate_request",
)


def _imports(path: Path) -> list[str]:
    """Every module and ``module.member`` a file imports (absolute imports, any depth)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _names(path: Path) -> set[str]:
    """Every name and attribute a module mentions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name.rsplit(".", 1)[-1])
    return found


# ---------------------------------------------------------------------------- source rules
def test_llm_never_reaches_the_executor_for_its_tokenizer() -> None:
    llm = REPO / "runtime/llm.py"
    reached = _names(llm) & {"executor", "worker", "loaded", "UniprocExecutor"}
    banned = (
        "tokenwire.runtime.executor",
        "tokenwire.runtime.worker",
        "tokenwire.runtime.loader.model_loader",
    )
    imported = [n for n in _imports(llm) if any(n == b or n.startswith(b + ".") for b in banned)]
    assert (sorted(reached), imported) == ([], [])


@pytest.mark.parametrize("module", ["runtime/llm.py", "runtime/engine/async_engine.py"])
def test_both_fronts_hold_a_frontend_and_compose_none_of_its_parts(module: str) -> None:
    names = _names(REPO / module)
    assert "Frontend" in names
    assert sorted(names & set(FRONT_PARTS)) == []


def test_chat_rendering_has_one_home() -> None:
    """Outside the front package nothing in the runtime or the server renders a chat itself:
    the served path, ``LLM.chat`` and ``tokenwire generate --chat`` go through a Frontend."""
    bad = [
        (str(p.relative_to(REPO)), n)
        for folder in ("runtime", "server")
        for p in sorted((REPO / folder).rglob("*.py"))
        if not p.is_relative_to(REPO / "runtime/front")
        for n in _imports(p)
        if n == "tokenwire.runtime.front.tokenizer.apply_chat_template"
    ]
    assert bad == []


# ---------------------------------------------------------------------------- behaviour
class _WorkersTokenizer:
    """What the worker loads in the poisoned test: any use by the front fails loudly."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the front used the worker's tokenizer ({name})")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the front used the worker's tokenizer to encode")


@pytest.fixture()
def poisoned_llm(monkeypatch: pytest.MonkeyPatch, tiny_model_with_tokenizer: Path) -> Iterator[LLM]:
    """An LLM whose worker holds an unusable tokenizer: only a front that loads its own from
    the published info can tokenize, render chats and detokenize."""
    loads: list[Path] = []

    def poisoned(path: str | Path, chat_template: str | None = None) -> Any:
        loads.append(Path(path))
        return _WorkersTokenizer()

    monkeypatch.setattr(model_loader, "load_tokenizer", poisoned)
    llm = LLM(str(tiny_model_with_tokenizer), device="cpu", max_model_len=256)
    assert loads, "the worker no longer loads a tokenizer: the poison proves nothing"
    yield llm
    llm.shutdown()


def test_llm_generates_and_chats_with_the_tokenizer_of_the_published_info(
    poisoned_llm: LLM,
) -> None:
    info = engine_info(poisoned_llm.engine)
    assert info.tokenizer_path is not None
    real = load_tokenizer(info.tokenizer_path, info.chat_template)
    assert real is not None

    out = poisoned_llm.generate(["Hello world"], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == list(real(["Hello world"])["input_ids"][0])
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert out.outputs[0].text == real.decode(out.outputs[0].token_ids)

    chat = poisoned_llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == apply_chat_template(real, MESSAGES)
    assert len(chat.outputs[0].token_ids) == GREEDY.max_tokens
    assert not poisoned_llm.engine.has_unfinished_requests()
    assert isinstance(poisoned_llm.frontend, Frontend)
    assert not isinstance(poisoned_llm.tokenizer, _WorkersTokenizer)


def test_served_and_offline_fronts_share_the_frontend(tiny_model_with_tokenizer: Path) -> None:
    """The same class in both fronts, and the same pipeline: a chat served over gRPC yields
    the prompt and greedy tokens ``LLM.chat`` yields."""
    llm = LLM(str(tiny_model_with_tokenizer), device="cpu", max_model_len=256)
    harness = ServerHarness(tiny_model_with_tokenizer, in_process=True).start()
    try:
        engine = harness.engine
        assert isinstance(engine, AsyncEngine)
        assert type(engine.frontend) is type(llm.frontend) is Frontend
        assert engine.tokenizer is engine.frontend.tokenizer
        assert harness.server.tokenizers is not None
        assert harness.server.tokenizers.frontend is engine.frontend
        request = generation_pb2.GenerateRequest(
            chat=common_pb2.ChatInput(messages=[common_pb2.ChatMessage(**m) for m in MESSAGES]),
            sampling=common_pb2.SamplingOptions(temperature=0.0),
            stopping=common_pb2.StoppingOptions(max_tokens=GREEDY.max_tokens, ignore_eos=True),
        )
        with harness.channel() as channel:
            served = generation_pb2_grpc.GenerationServiceStub(channel).Generate(
                request, timeout=60
            )
        offline = llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0]
        assert served.usage.prompt_tokens == len(offline.prompt_token_ids)
        assert list(served.choices[0].token_ids) == offline.outputs[0].token_ids
        assert served.choices[0].text == offline.outputs[0].text
        harness.assert_idle()
    finally:
        harness.stop()
        llm.shutdown()


class _ThreadRecordingFrontend(Frontend):
    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer, vocab_size=1 << 20, max_model_len=256)
        self.threads: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.get_ident())
        return super().encode(text, add_special_tokens)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
    ) -> list[int]:
        self.threads.append(threading.get_ident())
        return super().render_chat(messages, tools, chat_template=chat_template)


def test_the_server_runs_the_frontends_tokenization_off_the_loop(
    tiny_model_with_tokenizer: Path,
) -> None:
    tokenizer = load_tokenizer(tiny_model_with_tokenizer)
    assert tokenizer is not None
    front = _ThreadRecordingFrontend(tokenizer)

    async def served() -> tuple[int, list[int], list[int]]:
        pool = TokenizerPool(front, max_prompt_bytes=1 << 20)
        try:
            ids = await pool.encode("text", "Hello world")
            chat = await pool.render_chat("chat", MESSAGES)
        finally:
            pool.shutdown()
        return threading.get_ident(), ids, chat

    loop_thread, ids, chat = asyncio.run(served())
    assert len(front.threads) == 2 and loop_thread not in front.threads
    assert ids == list(tokenizer(["Hello world"])["input_ids"][0])
    assert chat == apply_chat_template(tokenizer, MESSAGES)
