"""The chart's optional gateway (issue 28): SMG discovering the replicas by label, and an
InferencePool for llm-d's / GIE's endpoint picker. Rendered by the real ``helm`` binary, every
manifest schema-checked (helm_render.render); the gateway's arguments are parsed by SMG's own
argument parser (the ``smg`` wheel) and the replicas' by the real ``tokenwire serve`` parser,
so a flag either side does not know fails here."""

from __future__ import annotations

from typing import Any

import pytest
from helm_render import CHART, NS, one, render, render_fails

from tokenwire.server.cli import build_parser

GATEWAY_VALUES = str(CHART / "ci" / "gateway-values.yaml")
HTTP_GATEWAY_VALUES = str(CHART / "ci" / "gateway-http-values.yaml")


def _pod(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return one(docs, "Deployment", name)["spec"]["template"]  # type: ignore[no-any-return]


def _replica_args(docs: list[dict[str, Any]]) -> Any:
    (c,) = _pod(docs, "tw-tokenwire")["spec"]["containers"]
    return build_parser().parse_args(["serve", *c["args"]])


def _smg(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], Any]:
    from smg.launch_router import parse_router_args

    (c,) = _pod(docs, "tw-tokenwire-smg")["spec"]["containers"]
    assert c["command"] == ["smg"] and c["args"][0] == "launch"
    return c, parse_router_args(c["args"][1:])


def test_smg_discovers_the_replicas_over_the_vllm_engine_protocol() -> None:
    docs = render("-f", GATEWAY_VALUES)
    c, args = _smg(docs)
    replica_labels = _pod(docs, "tw-tokenwire")["metadata"]["labels"]
    selector = dict(args.selector)  # SMG parses key=value pairs itself
    assert selector and selector.items() <= replica_labels.items()  # it finds every replica
    assert (
        _pod(docs, "tw-tokenwire-smg")["metadata"]["labels"].items()
        >= {"app.kubernetes.io/instance": "tw"}.items()
    )
    assert not selector.items() <= _pod(docs, "tw-tokenwire-smg")["metadata"]["labels"].items()
    assert args.service_discovery and args.service_discovery_namespace == NS
    replica_args = _replica_args(docs)
    assert args.service_discovery_port == replica_args.grpc_port
    assert replica_args.worker_protocol == "vllm"  # the replicas speak what the gateway dials
    # cache_aware over gRPC workers reads each replica's SubscribeKvEvents stream (in-process
    # hub, no ZMQ port): the chart turns the events on, and off on request.
    events = replica_args.kv_events_config
    assert events.enable_kv_cache_events and events.publisher == "null"
    off = _replica_args(render("-f", GATEWAY_VALUES, "--set", "gateway.smg.kvEvents=false"))
    assert off.kv_events_config is None
    assert args.policy == "cache_aware" and args.routing_key_headers == ["x-session-id"]
    assert args.api_key is None and "env" not in c  # keyless gRPC workers
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": args.port, "metrics": args.prometheus_port}
    svc = one(docs, "Service", "tw-tokenwire-smg")
    assert (
        svc["spec"]["selector"].items()
        <= _pod(docs, "tw-tokenwire-smg")["metadata"]["labels"].items()
    )


def test_smg_may_watch_pods_and_nothing_else() -> None:
    docs = render("-f", GATEWAY_VALUES)
    pod = _pod(docs, "tw-tokenwire-smg")["spec"]
    role, binding = one(docs, "Role"), one(docs, "RoleBinding")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (subject,) = binding["subjects"]
    assert subject == {
        "kind": "ServiceAccount",
        "name": pod["serviceAccountName"],
        "namespace": NS,
    }
    assert one(docs, "ServiceAccount", pod["serviceAccountName"])
    # The replicas' own account still mounts no token: only the gateway talks to the API.
    replica = _pod(docs, "tw-tokenwire")["spec"]
    assert replica["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_smg_over_http_workers_targets_the_rest_shim_with_the_key() -> None:
    docs = render("-f", HTTP_GATEWAY_VALUES)
    c, args = _smg(docs)
    replica_args = _replica_args(docs)
    assert args.service_discovery_port == replica_args.port
    assert replica_args.worker_protocol != "vllm"  # nothing extra on the replicas
    assert replica_args.kv_events_config is None  # SMG reads no KV events from HTTP workers
    # The replicas' key reaches the gateway as an env var the kubelet expands into --api-key.
    assert args.api_key == "$(TOKENWIRE_API_KEY)"
    (env,) = c["env"]
    assert env["name"] == "TOKENWIRE_API_KEY"
    assert env["valueFrom"]["secretKeyRef"] == {"name": "tokenwire-api-key", "key": "api-key"}
    no_key = render("--set", "gateway.smg.enabled=true", "--set", "gateway.smg.workerProtocol=http")
    assert _smg(no_key)[1].api_key is None  # no key configured, none passed


def test_inference_pool_selects_the_replicas_with_the_vllm_metric_mapping() -> None:
    docs = render("-f", GATEWAY_VALUES)
    pool = one(docs, "InferencePool")["spec"]
    template = _pod(docs, "tw-tokenwire")
    assert pool["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (c,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert pool["targetPorts"] == [{"number": ports["http"]}] and "appProtocol" not in pool
    assert pool["endpointPickerRef"] == {
        "name": "tw-tokenwire-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    labels = template["metadata"]["labels"]
    assert labels["llm-d.ai/engine-type"] == labels["inference.networking.k8s.io/engine-type"]
    assert labels["llm-d.ai/engine-type"] == "vllm"
    assert _replica_args(docs).metrics_compat == "both"  # the gauges under vLLM's names too
    grpc_pool = one(
        render(
            "--set",
            "gateway.inferencePool.enabled=true",
            "--set",
            "gateway.inferencePool.protocol=grpc",
        ),
        "InferencePool",
    )["spec"]
    assert grpc_pool["targetPorts"] == [{"number": ports["grpc"]}]
    assert grpc_pool["appProtocol"] == "kubernetes.io/h2c"


def test_default_chart_has_no_gateway() -> None:
    docs = render()
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"InferencePool", "Role", "RoleBinding"}
    labels = _pod(docs, "tw-tokenwire")["metadata"]["labels"]
    assert not any("engine-type" in k for k in labels)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (("gateway.smg.enabled=true", "gateway.smg.workerProtocol=ws"), "workerProtocol"),
        (
            (
                "gateway.smg.enabled=true",
                "gateway.smg.workerProtocol=http",
                "server.rest.enabled=false",
            ),
            "server.rest.enabled",
        ),
        (
            ("gateway.smg.enabled=true", "tls.enabled=true", "tls.cert=x", "tls.key=y"),
            "tls.enabled",
        ),
        (("gateway.inferencePool.enabled=true", "gateway.inferencePool.protocol=tcp"), "protocol"),
        (("gateway.smg.enabled=true", "apiKey.existingSecret=k"), "sends no authorization"),
    ],
)
def test_gateway_misconfiguration_fails_to_render(values: tuple[str, ...], message: str) -> None:
    args = [a for v in values for a in ("--set", v)]
    assert message in render_fails(*args)
