"""Serving as a KServe InferenceService in Knative mode: request-driven autoscaling.

Knative scales on concurrency (in-flight requests per replica, `scaleTarget`), keeps
`minReplicas` warm and caps at `maxReplicas`; a canary is Knative's revision split
(`canaryTrafficPercent` to the newest revision, the rest to the previous ready one).

Knative admits only a subset of the pod spec: no `lifecycle` and no
`terminationGracePeriodSeconds`. Draining is done by Knative's queue-proxy sidecar, which
stops routing to a terminating pod and waits for its in-flight requests; the pod's grace
period is the revision timeout (`timeout` here), set long enough to finish a stream.
PVC volumes, affinity and tolerations need Knative's `kubernetes.podspec-*` feature flags
(docs/kubernetes.md lists them).
"""

from __future__ import annotations

from typing import Any

from modelship.deploy.context import RenderContext
from modelship.deploy.deployment import disruption_budget, serves_annotation
from modelship.deploy.names import labels, metadata, selector
from modelship.deploy.pod import (
    data_volume,
    engine_container,
    gpu_scheduling,
    prometheus_annotations,
    termination_grace_s,
)

Json = dict[str, Any]
PREDICTOR = "predictor"


def inference_service(ctx: RenderContext) -> Json:
    serving = ctx.serving
    canary = serving.canary
    # With a canary the newest revision serves the canary release; Knative keeps the
    # previous revision (the stable release) for the remaining traffic.
    release = canary.release if canary is not None else serving.release
    container = engine_container(ctx, name="kserve-container", release=release, port_name=None)
    annotations = {
        "serving.kserve.io/enable-prometheus-scraping": "true",
        "prometheus.kserve.io/port": str(ctx.port),
        "prometheus.kserve.io/path": "/metrics",
        "modelship.io/serves": serves_annotation(release),
        **prometheus_annotations(ctx.port),
        # Knative scales up at once on bursts (panic mode); scale-down waits like the HPA's.
        "autoscaling.knative.dev/scale-down-delay": f"{serving.scale_down_stabilization_s}s",
    }
    predictor: Json = {
        "minReplicas": serving.min_replicas,
        "maxReplicas": serving.max_replicas,
        "scaleMetric": "concurrency",
        "scaleTarget": serving.target_concurrency,
        "timeout": max(serving.request_timeout_s, termination_grace_s(ctx)),
        "labels": selector(ctx.name, PREDICTOR),
        "annotations": annotations,
        "containers": [container],
        "volumes": [data_volume(ctx, read_only=True)],
        **gpu_scheduling(serving.gpu),
    }
    if canary is not None:
        predictor["canaryTrafficPercent"] = canary.weight
    meta = metadata(ctx.name, ctx.namespace, labels(ctx.name, "inference-service"))
    meta["annotations"] = {"serving.kserve.io/deploymentMode": "Knative"}
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": meta,
        "spec": {"predictor": predictor},
    }


def kserve_serving(ctx: RenderContext) -> list[Json]:
    """The InferenceService and a PodDisruptionBudget over its predictor pods."""
    return [
        inference_service(ctx),
        disruption_budget(ctx, f"{ctx.name}-{PREDICTOR}", PREDICTOR),
    ]
