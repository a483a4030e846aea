"""Offline schema validation of a render (no cluster): what `kubectl apply` would reject.

Core kinds go through `kubernetes-validate --strict` at a pinned Kubernetes version; the
custom resources (Argo Workflow, KServe InferenceService, KEDA ScaledObject) through the
strict CRD-derived JSON schemas kept in `shared/k8s-schemas` next to the repository, where
an unknown or misspelt field is an error. The InferenceService predictor is also checked
as the Knative Service KServe turns it into, because Knative admits only part of a pod spec.

Needs the dev extras: `pip install -c constraints.txt -e '.[dev]'`.
"""

from __future__ import annotations

import gzip
import json
import os
from functools import cache
from pathlib import Path
from typing import Any

Json = dict[str, Any]
KUBERNETES_VERSION = "1.33.0"  # pinned: what `kubernetes-validate -k` checks against
SCHEMAS_ENV = "MODELSHIP_K8S_SCHEMAS"
CRD_SCHEMAS = {
    ("argoproj.io/v1alpha1", "Workflow"): "argoproj.io/workflow_v1alpha1-strict.json.gz",
    ("serving.kserve.io/v1beta1", "InferenceService"): (
        "serving.kserve.io/inferenceservice_v1beta1-strict.json.gz"
    ),
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh/scaledobject_v1alpha1-strict.json.gz",
    ("serving.knative.dev/v1", "Service"): "serving.knative.dev/service_v1-strict.json.gz",
}
# InferenceService predictor fields that are KServe's own, not the pod's.
_KSERVE_ONLY = {
    "minReplicas", "maxReplicas", "scaleMetric", "scaleMetricType", "scaleTarget",
    "canaryTrafficPercent", "containerConcurrency", "timeout", "labels", "annotations",
    "logger", "batcher", "storageUris", "deploymentStrategy", "autoScaling", "workerSpec",
}  # fmt: skip


class ValidationUnavailable(RuntimeError):
    """A validator's package or the schema folder is missing; the message says how to fix."""


def default_schema_dir() -> Path:
    """`$MODELSHIP_K8S_SCHEMAS`, else `shared/k8s-schemas` beside the repository checkout."""
    if os.environ.get(SCHEMAS_ENV):
        return Path(os.environ[SCHEMAS_ENV])
    repo_root = Path(__file__).resolve().parents[3]
    return repo_root.parent / "shared" / "k8s-schemas"


@cache
def _crd_schema(path: Path) -> Json:
    with gzip.open(path, "rt") as handle:
        return json.load(handle)


def _jsonschema_errors(obj: Json, schema_path: Path) -> list[str]:
    try:
        import jsonschema
    except ImportError:
        raise ValidationUnavailable(
            "jsonschema is not installed: pip install -c constraints.txt jsonschema"
        ) from None
    if not schema_path.is_file():
        raise ValidationUnavailable(f"{schema_path}: schema file missing (see {SCHEMAS_ENV})")
    schema = _crd_schema(schema_path)
    validator_class = jsonschema.validators.validator_for(schema, jsonschema.Draft7Validator)
    errors = validator_class(schema).iter_errors(obj)
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '(top)'}: {error.message}"
        for error in sorted(errors, key=lambda e: list(map(str, e.absolute_path)))
    ]


def _core_errors(obj: Json, version: str) -> list[str]:
    try:
        import kubernetes_validate
    except ImportError:
        raise ValidationUnavailable(
            "kubernetes-validate is not installed: "
            "pip install -c constraints.txt kubernetes-validate"
        ) from None
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(str(p) for p in error.path) or "(top)"
        return [f"{path}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [error.message]
    return []


def knative_view(isvc: Json) -> Json:
    """The Knative Service KServe (Knative mode) creates for the predictor, pod fields only."""
    predictor = isvc["spec"]["predictor"]
    pod = {key: value for key, value in predictor.items() if key not in _KSERVE_ONLY}
    if "timeout" in predictor:
        pod["timeoutSeconds"] = predictor["timeout"]
    if "containerConcurrency" in predictor:
        pod["containerConcurrency"] = predictor["containerConcurrency"]
    return {
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Service",
        "metadata": {"name": f"{isvc['metadata']['name']}-predictor"},
        "spec": {"template": {"spec": pod}},
    }


def object_errors(obj: Json, schema_dir: Path, version: str = KUBERNETES_VERSION) -> list[str]:
    """Problems the API server (or the CRD's webhook-free schema) would report for `obj`."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key not in CRD_SCHEMAS:
        return _core_errors(obj, version)
    errors = _jsonschema_errors(obj, schema_dir / "strict" / CRD_SCHEMAS[key])
    if key[1] == "InferenceService":
        view = knative_view(obj)
        schema = schema_dir / "strict" / CRD_SCHEMAS[("serving.knative.dev/v1", "Service")]
        errors += [f"as Knative Service: {e}" for e in _jsonschema_errors(view, schema)]
        for container in view["spec"]["template"]["spec"].get("containers", []):
            if len(container.get("ports", [])) > 1:
                errors.append("as Knative Service: a container may expose one port only")
    return errors


def validate_objects(
    objects: list[Json], schema_dir: Path | None = None, version: str = KUBERNETES_VERSION
) -> list[str]:
    """All schema problems of a render as `Kind/name: path: message` lines (empty: valid)."""
    folder = schema_dir or default_schema_dir()
    problems = []
    for obj in objects:
        meta = obj.get("metadata", {})
        name = f"{obj.get('kind')}/{meta.get('name') or meta.get('generateName')}"
        problems += [f"{name}: {error}" for error in object_errors(obj, folder, version)]
    return problems
