"""The docs stay true to the code: every ``tokenwire ...`` command in README.md and docs/*.md
parses with the real ``tokenwire`` parser (``tokenwire.server.cli.build_parser``, abbreviations
off, so a renamed or invented flag fails), and every relative link points at a file, and at a
heading of it, that exists.

Commands come from fenced shell blocks (every line) and from inline code spans in the prose
that start a shell command with ``tokenwire``. Placeholder rule, applied before splitting:
``[...]`` is dropped, an optional part ``[--flag VALUE]`` / ``[MODEL]`` is kept without its
brackets (so its flags are checked too), and the value placeholders in ``PLACEHOLDER_VALUES``
become a value of the right type. Nothing is run: ``parse_args`` only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tokenwire.server.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# A block in another language (or none) must not hide a command from the check.
COMMAND_START = re.compile(r"^\s*(?:[A-Za-z_]\w*=\S*\s+)*(?:\S*/)?tokenwire\s+[a-z]")
# Placeholders for values the parser checks by type (int / seconds); others are plain strings.
PLACEHOLDER_VALUES = {"N": "3", "SECONDS": "30"}
SHELL_OPERATORS = {"|", "||", "&", "&&", ";", "(", ")"}
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`([^`]+)`")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line, for the failure message
    text: str  # the command as the doc writes it (continuations joined)
    argv: tuple[str, ...]  # what follows `tokenwire`
    inline: bool  # from a code span in the prose (bare `tokenwire SUB` names are allowed)


def _split_fences(path: Path) -> tuple[list[tuple[int, str, list[str]]], list[tuple[int, str]]]:
    """(fenced blocks as (first line number, language, lines), prose lines as (number, text))."""
    blocks: list[tuple[int, str, list[str]]] = []
    prose: list[tuple[int, str]] = []
    current: tuple[int, str, list[str]] | None = None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fence = FENCE.match(line)
        if fence and current is None:
            current = (number + 1, fence.group(2).lower(), [])
        elif fence and current is not None:
            blocks.append(current)
            current = None
        elif current is not None:
            current[2].append(line)
        else:
            prose.append((number, line))
    assert current is None, f"{path.name}: unclosed code fence"
    return blocks, prose


def _logical_lines(first: int, lines: list[str]) -> list[tuple[int, str]]:
    """Shell lines with ``\\`` continuations and multi-line quoted arguments joined."""
    out: list[tuple[int, str]] = []
    pending, start = "", first
    for offset, line in enumerate(lines):
        if not pending:
            start = first + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        pending += line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the argument goes on on the next line
            pending += "\n"
            continue
        out.append((start, pending))
        pending = ""
    assert not pending, f"line {start}: unterminated shell command"
    return out


def _tokenwire_argvs(text: str) -> list[tuple[str, ...]]:
    """The argv after ``tokenwire`` of every simple command in a shell line that runs it."""
    text = text.replace("[...]", " ")
    text = re.sub(r"\[((?:-|[A-Z])[^\[\]]*)\]", r" \1 ", text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    segments: list[list[str]] = [[]]
    for token in lexer:
        if token in SHELL_OPERATORS:
            segments.append([])
        else:
            segments[-1].append(token)
    found = []
    for words in segments:
        while words and ENV_ASSIGNMENT.match(words[0]):
            words = words[1:]
        if words and (words[0] == "tokenwire" or words[0].endswith("bin/tokenwire")):
            args = [PLACEHOLDER_VALUES.get(w, w) for w in words[1:] if w != "..."]
            found.append(tuple(args))
    return found


def doc_commands() -> list[DocCommand]:
    commands: list[DocCommand] = []
    for path in DOC_FILES:
        name = path.relative_to(ROOT).as_posix()
        blocks, prose = _split_fences(path)
        for first, lang, lines in blocks:
            if lang not in SHELL_LANGS:
                hidden = [line for line in lines if COMMAND_START.match(line)]
                assert not hidden, f"{name}:{first}: a {lang or 'plain'} block runs {hidden}"
                continue
            for number, text in _logical_lines(first, lines):
                for argv in _tokenwire_argvs(text):
                    commands.append(DocCommand(f"{name}:{number}", text.strip(), argv, False))
        for number, text in _inline_spans(prose):
            for argv in _tokenwire_argvs(text):
                if argv:  # a bare `tokenwire` in the prose is the name (a service, a package)
                    commands.append(DocCommand(f"{name}:{number}", text, argv, True))
    return commands


def _inline_spans(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Code spans of the prose (a span may run over a line break), with their first line."""
    text = "\n".join(line for _, line in prose)
    starts = [0]
    for _, line in prose:
        starts.append(starts[-1] + len(line) + 1)
    spans = []
    for match in INLINE_CODE.finditer(text):
        index = next(i for i, start in enumerate(starts) if start > match.start()) - 1
        spans.append((prose[index][0], match.group(1).replace("\n", " ")))
    return spans


def _strict(parser: argparse.ArgumentParser) -> None:
    """No abbreviated flags anywhere: a doc's ``--kv-cache-mem`` must not pass as a prefix."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _strict(sub)


def _subcommand_depth(parser: argparse.ArgumentParser, argv: tuple[str, ...]) -> int:
    """How many leading words of argv name (nested) subcommands; raises on an unknown one."""
    depth = 0
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return depth
        assert depth < len(argv), f"missing subcommand after {argv[:depth]}"
        word = argv[depth]
        assert word in subs[0].choices, f"unknown subcommand {word!r}"
        parser, depth = subs[0].choices[word], depth + 1


COMMANDS = doc_commands()


def test_docs_have_commands() -> None:
    """The extraction finds the commands it is meant to check (guards the extractor itself)."""
    fenced = [c for c in COMMANDS if not c.inline]
    assert len(fenced) >= 15, [c.text for c in fenced]
    assert len(COMMANDS) - len(fenced) >= 20
    subcommands = {c.argv[0] for c in COMMANDS if c.argv}
    assert {"serve", "chat", "generate", "worker", "rest", "bench", "hash-key"} <= subcommands


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.where)
def test_doc_command_parses(command: DocCommand) -> None:
    parser = build_parser()
    _strict(parser)
    depth = _subcommand_depth(parser, command.argv)
    if command.inline and depth == len(command.argv):
        return  # a bare `tokenwire serve` in the prose names the command, nothing more
    stderr = io.StringIO()
    parsed = True
    with contextlib.redirect_stderr(stderr):
        try:
            parser.parse_args(list(command.argv))
        except SystemExit:  # argparse's error(): usage and message on stderr, exit 2
            parsed = False
    assert parsed, f"{command.where}: `{command.text}` does not parse: {stderr.getvalue()}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    _, prose = _split_fences(path)
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in prose:
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def doc_links() -> list[tuple[str, Path, str]]:
    """(where, linking file, target) of every link in the prose that is not a URL."""
    links = []
    for path in DOC_FILES:
        _, prose = _split_fences(path)
        for number, line in prose:
            for target in LINK.findall(INLINE_CODE.sub("", line)):
                if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    links.append((f"{path.relative_to(ROOT).as_posix()}:{number}", path, target))
    return links


LINKS = doc_links()


def test_docs_have_links() -> None:
    assert len(LINKS) >= 30, LINKS


@pytest.mark.parametrize(("where", "source", "target"), LINKS, ids=[w for w, _, _ in LINKS])
def test_doc_link_resolves(where: str, source: Path, target: str) -> None:
    file_part, _, anchor = target.partition("#")
    resolved = (source.parent / file_part).resolve() if file_part else source
    assert resolved.exists(), f"{where}: link {target!r}: no file {file_part!r}"
    assert resolved.is_relative_to(ROOT), f"{where}: link {target!r} leaves the repository"
    if anchor and resolved.suffix == ".md":
        anchors = _anchors(resolved)
        assert anchor in anchors, f"{where}: no heading #{anchor} in {resolved.name}: {anchors}"


def test_index_lists_every_page() -> None:
    """docs/index.md links every page of docs/, and the README links the index."""
    index = ROOT / "docs" / "index.md"
    listed = {target for where, _, target in LINKS if where.startswith("docs/index.md:")}
    pages = {p.name for p in DOC_FILES if p.parent == index.parent and p != index}
    assert pages <= listed, sorted(pages - listed)
    readme_links = {target for where, _, target in LINKS if where.startswith("README.md:")}
    assert "docs/index.md" in readme_links
