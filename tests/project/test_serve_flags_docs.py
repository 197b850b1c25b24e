"""``docs/serving.md`` lists every flag of ``tokenwire serve``, and the serve help is built
from what the server has: every registered tool-call and reasoning parser is described in
its flag's help, and the ``--api-key-file`` help points at a section that exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tokenwire.server.cli import build_parser
from tokenwire.server.tool_parsers.output import REASONING_PARSERS, TOOL_PARSERS

ROOT = Path(__file__).resolve().parents[2]


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["serve"]
    raise AssertionError("tokenwire has no serve subcommand")


def _help(option: str) -> str:
    for action in _serve_parser()._actions:
        if option in action.option_strings:
            return action.help or ""
    raise AssertionError(f"serve has no {option}")


def test_serving_md_lists_every_serve_flag() -> None:
    raw = (ROOT / "docs" / "serving.md").read_text()
    text = raw + raw.replace("--[no-]", "--no-") + raw.replace("--[no-]", "--")  # both forms
    options = {o for a in _serve_parser()._actions for o in a.option_strings}
    options -= {"-h", "--help"}
    missing = sorted(o for o in options if not re.search(rf"{re.escape(o)}(?![\w-])", text))
    assert not missing, f"docs/serving.md does not list: {missing}"


def test_parser_help_describes_every_registered_parser() -> None:
    tool_help, reasoning_help = _help("--tool-call-parser"), _help("--reasoning-parser")
    assert [n for n in TOOL_PARSERS if f"{n}: " not in tool_help] == []
    assert [n for n in REASONING_PARSERS if f"{n}: " not in reasoning_help] == []


def test_api_key_file_help_points_at_a_real_section() -> None:
    link = re.search(r"docs/([\w.-]+\.md)#([\w-]+)", _help("--api-key-file"))
    assert link is not None
    page = (ROOT / "docs" / link.group(1)).read_text()
    anchors = {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", page, re.M)
    }
    assert link.group(2) in anchors
