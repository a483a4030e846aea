"""Values for the Helm chart (deploy/helm/modelship) from the same config.

The chart renders the deployment-serving objects of `serving.yaml`; a test renders both
and compares them, and checks that the chart's own values.yaml equals these values for the
default config, so the two stay one design.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from modelship.deploy.config import GpuConfig, Resources
from modelship.deploy.context import RenderContext
from modelship.deploy.deployment import replica_bounds
from modelship.deploy.pod import engine_flags

if TYPE_CHECKING:  # deploy reads the gateway's section from the config, never imports it
    from modelship.gateway.tiers import TierConfig

Json = dict[str, Any]


def _resources(spec: Resources) -> Json:
    return {"requests": dict(spec.requests), "limits": dict(spec.limits)}


def _gpu(gpu: GpuConfig | None) -> Json | None:
    if gpu is None:
        return None
    return {
        "count": gpu.count,
        "resource": gpu.resource,
        "nodeLabels": dict(gpu.node_labels),
        "tolerations": [t.model_dump(exclude_none=True) for t in gpu.tolerations],
    }


def _tier(tier: TierConfig) -> Json:
    return {
        "name": tier.name,
        "variant": tier.variant,
        "minReplicas": tier.min_replicas,
        "maxReplicas": tier.max_replicas,
    }


def _model(ctx: RenderContext) -> Json:
    """Another model behind the gateway (`models:`): its engines serve its production
    release as <name>-<label>-engine, scaled between its own bounds."""
    assert ctx.model is not None
    _, _, low, high = replica_bounds(ctx)
    return {
        "slug": ctx.slug,
        "servedModelName": ctx.served_model_name,
        "label": ctx.model_label,
        "minReplicas": low,
        "maxReplicas": high,
    }


def helm_values(ctx: RenderContext) -> Json:
    serving = ctx.serving
    canary = serving.canary
    return {
        "name": ctx.name,
        "namespace": ctx.namespace,
        "image": ctx.deploy.image,
        "imagePullPolicy": ctx.deploy.image_pull_policy,
        "pvcName": ctx.pvc_name,
        "configMapName": ctx.config_map_name,
        "apiKeySecret": ctx.api_key_secret,
        "model": {
            "slug": ctx.slug,
            "servedModelName": ctx.served_model_name,
            "release": serving.release,
        },
        "engine": {
            "kind": serving.engine,
            "vllmImage": serving.vllm_image,
            "port": ctx.port,
            "flags": engine_flags(ctx),
            "gracePeriodSeconds": ctx.config.serve.grace_period_s,
            "stallTimeoutSeconds": ctx.config.serve.stall_timeout_s,
            "drainDelaySeconds": serving.drain_delay_s,
            "resources": _resources(serving.resources),
            "gpu": _gpu(serving.gpu),
        },
        "autoscaling": {
            "autoscaler": serving.autoscaler,
            "minReplicas": serving.min_replicas,
            "maxReplicas": serving.max_replicas,
            "targetConcurrency": serving.target_concurrency,
            "targetWaiting": serving.target_waiting,
            "scaleUpStabilizationSeconds": serving.scale_up_stabilization_s,
            "scaleDownStabilizationSeconds": serving.scale_down_stabilization_s,
            "prometheusUrl": serving.prometheus_url,
        },
        "canary": None
        if canary is None
        else {"release": canary.release, "weight": canary.weight, "replicas": canary.replicas},
        "tiers": [_tier(tier) for tier in ctx.config.gateway.variant_tiers],
        "models": [_model(ctx.for_model(entry)) for entry in ctx.config.models],
        "gateway": {
            "replicas": serving.gateway.replicas,
            "port": serving.gateway.port,
            "resources": _resources(serving.gateway.resources),
        },
        "podDisruptionBudget": {"maxUnavailable": serving.max_unavailable},
    }
