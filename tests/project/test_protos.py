"""Committed generated gRPC code matches what ``make protos`` produces from the .proto files."""

from __future__ import annotations

import filecmp
from pathlib import Path

import google.rpc.status_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
# Hand-written modules beside the generated code (everything else there comes from protoc).
HAND_WRITTEN = {"__init__.py", "reasons.py"}


def test_generated_code_has_no_drift(tmp_path: Path) -> None:
    googleapis = Path(google.rpc.status_pb2.__file__).parents[2]
    sources = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "tokenwire/v1").glob("*.proto"))
    grpc_include = Path(protoc.__file__).parent / "_proto"
    code = protoc.main(
        [
            "protoc",
            f"-I{PROTOS}",
            f"-I{googleapis}",
            f"-I{grpc_include}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *sources,
        ]
    )
    assert code == 0
    generated = sorted(p.name for p in (tmp_path / "tokenwire/v1").iterdir())
    committed = sorted(
        p.name
        for p in (PROTOS / "tokenwire/v1").iterdir()
        if p.suffix in (".py", ".pyi") and p.name not in HAND_WRITTEN
    )
    assert generated == committed
    for name in generated:
        assert filecmp.cmp(
            tmp_path / "tokenwire/v1" / name, PROTOS / "tokenwire/v1" / name, shallow=False
        ), f"{name} drifted: run `make protos` and commit"


def test_error_reasons_travel_as_bare_names() -> None:
    """``ErrorInfo.reason`` carries the enum name without ``ERROR_REASON_`` and parses back."""
    from tokenwire.v1 import errors_pb2
    from tokenwire.v1.reasons import parse_reason, reason_name

    unspecified = errors_pb2.ERROR_REASON_UNSPECIFIED
    assert reason_name(errors_pb2.ERROR_REASON_QUEUE_FULL) == "QUEUE_FULL"
    names = set()
    for value in errors_pb2.ErrorReason.values():
        if value == unspecified:
            continue
        name = reason_name(value)
        assert name.isupper() and not name.startswith("ERROR_REASON_"), name
        assert parse_reason(name) == value
        names.add(name)
    assert len(names) == len(errors_pb2.ErrorReason.values()) - 1
    for unknown in (None, "", "NO_SUCH_REASON", "ERROR_REASON_QUEUE_FULL", "queue_full"):
        assert parse_reason(unknown) == unspecified
