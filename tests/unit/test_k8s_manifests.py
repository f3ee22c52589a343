"""deploy/k8s validated against the Kubernetes schemas (kubernetes-validate, offline), and checked for what
the deployment relies on: probes on /readyz and /healthz, secrets that exist, services that select pods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSION = "1.30"  # the oldest Kubernetes the manifests target (autoscaling/v2, policy/v1)


def documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    found = []
    for name in kustomization["resources"]:
        found += [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    return found


def test_the_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_is_valid_against_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)  # raises ValidationError with the path at fault


def test_a_broken_manifest_is_refused() -> None:
    broken = next(d for d in documents() if d["kind"] == "StatefulSet")
    broken = {**broken, "spec": {**broken["spec"], "replicas": "three"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)


def containers() -> list[tuple[str, dict[str, Any]]]:
    return [
        (d["metadata"]["name"], c)
        for d in documents()
        if d["kind"] in ("StatefulSet", "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


def test_every_container_is_probed_on_readyz_and_healthz_and_runs_as_non_root() -> None:
    workloads = [d for d in documents() if d["kind"] in ("StatefulSet", "Deployment")]
    assert {d["metadata"]["name"] for d in workloads} == {"core", "gateway-stomp", "gateway-mqtt", "gateway-amqp"}
    for workload in workloads:
        assert workload["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    for name, container in containers():
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", name
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", name
        ports = {p["name"] for p in container["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] in ports, f"{name} {probe} names no port of its container"


def test_referenced_secrets_exist_and_every_service_and_budget_selects_a_workload() -> None:
    docs = documents()
    secrets = {d["metadata"]["name"]: set(d["stringData"]) for d in docs if d["kind"] == "Secret"}
    for name, container in containers():
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                assert ref["key"] in secrets.get(ref["name"], set()), f"{name}: {ref} not defined"
    pod_labels = [
        d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] in ("StatefulSet", "Deployment")
    ]
    for doc in docs:
        if doc["kind"] == "Service":
            selector = doc["spec"]["selector"]
        elif doc["kind"] == "PodDisruptionBudget":
            selector = doc["spec"]["selector"]["matchLabels"]
        else:
            continue
        assert any(selector.items() <= labels.items() for labels in pod_labels), doc["metadata"]["name"]
    scaled = {d["spec"]["scaleTargetRef"]["name"] for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    assert scaled == {"gateway-stomp", "gateway-mqtt", "gateway-amqp"}
