"""Objects applied once before the pipeline runs: namespace, storage, config, the pipeline's
identity."""

from __future__ import annotations

from typing import Any

from modelship.deploy.context import RenderContext
from modelship.deploy.names import APP, CONFIG_FILE, DATA_ROOT, labels, metadata
from modelship.deploy.yaml_text import dump_yaml

Json = dict[str, Any]

# What the deploy step applies (kubectl apply needs get, create and patch) and what Argo's
# executor needs to report a step's outputs.
_APPLY_VERBS = ["get", "create", "patch", "update"]
_APPLIED = [
    ("apps", "deployments"),
    ("", "services"),
    ("policy", "poddisruptionbudgets"),
    ("autoscaling", "horizontalpodautoscalers"),
    ("keda.sh", "scaledobjects"),
    ("serving.kserve.io", "inferenceservices"),
]
_REPORT_RULE = {
    "apiGroups": ["argoproj.io"],
    "resources": ["workflowtaskresults"],
    "verbs": ["create", "patch"],
}
_APPLY_RULES = [
    {"apiGroups": [group], "resources": [resource], "verbs": _APPLY_VERBS}
    for group, resource in _APPLIED
]


def namespace(ctx: RenderContext) -> Json:
    """The namespace every other object lives in, so `kubectl apply -f cluster.yaml` is the
    first and only step before submitting the Workflow (no `kubectl create namespace`)."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        # No model's labels: several models may share one namespace, each render applying it.
        "metadata": {"name": ctx.namespace, "labels": {"app.kubernetes.io/managed-by": APP}},
    }


def persistent_volume_claim(ctx: RenderContext) -> Json:
    storage = ctx.deploy.storage
    spec: Json = {
        "accessModes": [storage.access_mode],
        "resources": {"requests": {"storage": storage.size}},
    }
    if storage.storage_class:
        spec["storageClassName"] = storage.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(storage.pvc_name, ctx.namespace, labels(ctx.name, "storage")),
        "spec": spec,
    }


def pipeline_yaml(ctx: RenderContext) -> str:
    """The config as the stages see it in the cluster: storage at the PVC, no secrets.

    Only the fields the user set are written, so the in-cluster defaults are the image's.
    The API key travels in a Secret (env MODELSHIP_API_KEY), never in a ConfigMap.
    """
    data = ctx.config.model_dump(mode="json", exclude_unset=True)
    data["storage"] = DATA_ROOT
    # The stages act on the model the config names, never on a guess from the PVC's
    # contents (`cli/model_choice.py`): the one the workflow's acquire step writes.
    data.setdefault("name", ctx.slug)
    serve = data.get("serve")
    if isinstance(serve, dict):
        serve.pop("api_key", None)
    return dump_yaml(data)


def config_map(ctx: RenderContext) -> Json:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(ctx.config_map_name, ctx.namespace, labels(ctx.name, "config")),
        "data": {CONFIG_FILE: pipeline_yaml(ctx)},
    }


def memo_cache(ctx: RenderContext) -> Json:
    """Argo's memoization cache; Argo 3.5+ only reads ConfigMaps carrying this label."""
    cache_labels = labels(ctx.name, "pipeline")
    cache_labels["workflows.argoproj.io/configmap-type"] = "Cache"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(ctx.memo_cache_name, ctx.namespace, cache_labels),
    }


def api_key_secret(ctx: RenderContext) -> Json:
    """From serve.api_key; prefer `deploy.serving.api_key_secret` naming a Secret you manage."""
    secret, key = ctx.api_key_secret, ctx.config.serve.api_key
    if secret is None or key is None:
        raise ValueError("no API key to put in a Secret (serve.api_key is not set)")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(secret, ctx.namespace, labels(ctx.name, "config")),
        "type": "Opaque",
        "stringData": {"api-key": key},
    }


def pipeline_identity(ctx: RenderContext) -> list[Json]:
    """ServiceAccount + Role + RoleBinding the Workflow's pods run as."""
    name = ctx.pipeline_service_account
    object_labels = labels(ctx.name, "pipeline")
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(name, ctx.namespace, object_labels),
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(name, ctx.namespace, object_labels),
        "rules": [_REPORT_RULE, *(_APPLY_RULES if ctx.deploy.workflow.deploy_step else [])],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(name, ctx.namespace, object_labels),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ctx.namespace}],
    }
    if ctx.deploy.workflow.service_account:  # the user's own account: bind nothing
        return []
    return [account, role, binding]


def cluster_objects(ctx: RenderContext) -> list[Json]:
    objects = [namespace(ctx)] if ctx.deploy.create_namespace else []
    objects += [persistent_volume_claim(ctx), config_map(ctx), memo_cache(ctx)]
    if ctx.renders_api_key_secret:
        objects.append(api_key_secret(ctx))
    return objects + pipeline_identity(ctx)
