"""Size and depth limits of a constraint, checked before any grammar work.

xgrammar's cost grows faster than linearly with a JSON schema's nesting (arrays 450 deep,
12 KB of text, take seconds to parse and longer to compile), so the length of every
constraint's text and the nesting of a schema document are bounded first. Length is O(1);
depth needs the document parsed by ``json`` (C, linear) and its containers walked, so it
runs where the grammar work runs: on a worker thread, never on an event loop.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tokenwire.runtime.structured.config import ConstraintLimits
from tokenwire.runtime.structured.params import GrammarSpec


def length_problem(spec: GrammarSpec, limits: ConstraintLimits) -> str | None:
    """Why ``spec`` is too long (None: it is not). O(1)."""
    if len(spec.text) <= limits.max_chars:
        return None
    return (
        f"is {len(spec.text)} characters long; the server allows at most "
        f"{limits.max_chars} (simplify the constraint)"
    )


def depth_problem(spec: GrammarSpec, limits: ConstraintLimits) -> str | None:
    """Why a JSON schema (or a structural tag, a JSON document holding schemas) nests too
    deep (None: it does not, or it is neither)."""
    if spec.kind not in ("json", "structural_tag") or not too_deep(spec.text, limits.max_depth):
        return None
    return f"nests deeper than {limits.max_depth} levels (the server's limit); flatten the schema"


def limits_problem(spec: GrammarSpec, limits: ConstraintLimits) -> str | None:
    return length_problem(spec, limits) or depth_problem(spec, limits)


def too_deep(text: str, max_depth: int) -> bool:
    """Whether the JSON document ``text`` nests containers deeper than ``max_depth``
    (``{}`` is 1). Text that is not JSON is left to the grammar parser's message."""
    try:
        document = json.loads(text)
    except RecursionError:
        return True  # deeper than the interpreter's recursion limit
    except ValueError:
        return False
    if not isinstance(document, (dict, list)):
        return False
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return True
        children: Iterable[Any] = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False
