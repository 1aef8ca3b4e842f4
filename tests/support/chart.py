"""The Helm chart for tests: rendered by Helm's own Go SDK (helm-python-sdk), each object
validated against the Kubernetes schemas (kubernetes-validate) or the copied CRD schemas of
tests/deploy/crds (unknown fields rejected), and a TLS Secret's files laid out as the chart
mounts them."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import yaml

from tests.support.certs import make_certs
from tests.support.processes import REPO

__all__ = ["CHART", "KUBE_VERSION", "OTHER_CRDS", "TLS_DIR", "by_kind", "render", "secret",
           "validate"]

CHART = REPO / "deploy" / "helm" / "kvswitch"
CRDS = REPO / "tests" / "deploy" / "crds"
KUBE_VERSION = "1.33"
TLS_DIR = "/etc/kvswitch-tls"
"""Where the chart mounts `tls.secretName`; the tests put certificates of their own there."""
# Kinds from other projects' CRDs not copied here: checked for their fields by the tests.
OTHER_CRDS = {("gateway.networking.k8s.io/v1", "HTTPRoute"),
              ("networking.gke.io/v1", "HealthCheckPolicy"),
              ("monitoring.coreos.com/v1", "ServiceMonitor")}


def render(values: Mapping[str, Any], name: str = "qwen3",
           namespace: str = "llm") -> list[dict[str, Any]]:
    chart = helm_python.Chart.load(str(CHART))
    files = chart.render(dict(values), name=name, namespace=namespace)
    return [doc for name, text in sorted(files.items()) if name.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _closed(schema: Any) -> Any:
    """`schema` with unknown fields rejected wherever it lists the fields (the API server prunes
    them silently, which would hide a misspelt one)."""
    if isinstance(schema, dict):
        schema = {key: _closed(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_closed(value) for value in schema]
    return schema


def _crd_schema(file: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / file).read_text())
    schema = dict(_closed(copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])))
    # Every object's own fields, which some CRDs leave out of their schema.
    for field in ("apiVersion", "kind", "metadata"):
        schema["properties"].setdefault(field, {"type": "object" if field == "metadata"
                                                else "string"})
    return schema


CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"):
        _crd_schema("inference.networking.k8s.io_inferencepools.yaml"),
    ("llm-d.ai/v1alpha2", "InferenceObjective"): _crd_schema("llm-d.ai_inferenceobjectives.yaml"),
    ("networking.istio.io/v1", "DestinationRule"):
        _crd_schema("networking.istio.io_destinationrules.yaml"),
}


def validate(docs: list[dict[str, Any]], namespace: str = "llm") -> None:
    assert docs
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_SCHEMAS:
            jsonschema.validate(doc, CRD_SCHEMAS[key])
        elif key in OTHER_CRDS:
            assert doc["metadata"]["namespace"] == namespace and doc["spec"], doc
        else:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def secret(directory: Path) -> Path:
    """A TLS Secret's files as the chart mounts them (cert-manager's layout: ca.crt, tls.crt,
    tls.key), in `directory`/secret; the certificate names localhost and 127.0.0.1."""
    files = directory / "secret"
    if not files.exists():
        files.mkdir()
        certs = make_certs(directory)
        for source, name in ((certs.ca, "ca.crt"), (certs.server_cert, "tls.crt"),
                             (certs.server_key, "tls.key")):
            shutil.copy(source, files / name)
    return files
