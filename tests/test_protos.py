"""Committed generated gRPC code matches what ``make protos`` produces from the .proto files."""

from __future__ import annotations

import filecmp
from pathlib import Path

import google.rpc.status_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


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
        if p.suffix in (".py", ".pyi") and p.name != "__init__.py"
    )
    assert generated == committed
    for name in generated:
        assert filecmp.cmp(
            tmp_path / "tokenwire/v1" / name, PROTOS / "tokenwire/v1" / name, shallow=False
        ), f"{name} drifted: run `make protos` and commit"
