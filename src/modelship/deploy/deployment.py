"""Serving as plain Kubernetes: engine Deployment + Service + PDB, HPA or KEDA, the gateway.

The engine replicas are scaled on their own load metrics (scraped from `/metrics` on the
serve port): in-flight requests per replica against `target_concurrency`, and queued
requests against `target_waiting`. A canary is a second, fixed-size Deployment serving a
pinned release behind its own Service; the gateway splits traffic between the two. Each of
`gateway.tiers` is one more Deployment + Service serving its optimized variant, autoscaled
between the tier's own `min_replicas` and `max_replicas`.

The engine Services are headless (`clusterIP: None`): the gateway watches their
EndpointSlices (`gateway/discovery.py`) and routes to each pod itself, so its prefix
affinity, load balancing, breakers and failover see every replica. The Services' labels,
which the EndpointSlice controller copies onto their slices, say which track and tier the
pods serve; the gateway's ServiceAccount may read the slices (and Leases, for electing one
gateway to run the fleet's single-writer work).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from modelship.deploy.context import RenderContext
from modelship.deploy.names import CONFIG_PATH, DATA_ROOT, labels, metadata, selector
from modelship.deploy.pod import (
    api_key_env,
    config_mount,
    config_volume,
    data_mount,
    data_volume,
    engine_container,
    gpu_scheduling,
    non_root,
    prestop_sleep,
    probes,
    prometheus_annotations,
    resources,
    termination_grace_s,
)

if TYPE_CHECKING:  # deploy reads the gateway's section from the config, never imports it
    from modelship.gateway.tiers import TierConfig

Json = dict[str, Any]
ENGINE = "engine"
GATEWAY = "gateway"
METRICS_PORT = 9090  # the Service port named `metrics` (a ServiceMonitor selects it by name)


def track_names(ctx: RenderContext, track: str) -> tuple[str, str]:
    """(object name, pod component label) of the stable or the canary engine (of another
    model: `<name>-<model>-engine`, component `<model>-engine`)."""
    component = ENGINE if ctx.model is None else f"{ctx.model_label}-{ENGINE}"
    if track == "canary":
        return f"{ctx.engine_prefix}-{ENGINE}-canary", f"{component}-canary"
    return f"{ctx.engine_prefix}-{ENGINE}", component


def tier_names(ctx: RenderContext, tier: TierConfig) -> tuple[str, str]:
    """(object name, pod component label) of a cheaper tier's engines."""
    return f"{ctx.name}-{ENGINE}-tier-{tier.name}", f"{ENGINE}-tier-{tier.name}"


def serves_annotation(release: int | None) -> str:
    return "production" if release is None else f"releases/{release}"


def engine_deployment(
    ctx: RenderContext, track: str = "stable", tier: TierConfig | None = None
) -> Json:
    """Engine replicas serving `production` (or a pinned release), the canary's release, or
    a cheaper tier's variant."""
    name, component = track_names(ctx, track) if tier is None else tier_names(ctx, tier)
    canary = ctx.serving.canary
    release = canary.release if track == "canary" and canary else ctx.serving.release
    if ctx.model is not None:  # another model: its own production release
        release = None
    pod_labels = selector(ctx.name, component)
    variant = None if tier is None else tier.variant
    container = engine_container(
        ctx, name=ENGINE, release=release, port_name="http", variant=variant
    )
    container["lifecycle"] = prestop_sleep(ctx.serving.drain_delay_s)
    pod_spec: Json = {
        "terminationGracePeriodSeconds": termination_grace_s(ctx),
        "containers": [container],
        "volumes": [data_volume(ctx, read_only=True)],
        **gpu_scheduling(ctx.serving.gpu),
    }
    annotations = prometheus_annotations(ctx.port)
    serves = serves_annotation(release) if variant is None else f"optimized/{variant}"
    annotations["modelship.io/serves"] = serves
    spec: Json = {
        "selector": {"matchLabels": selector(ctx.name, component)},
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        },
        "template": {
            "metadata": {"labels": pod_labels, "annotations": annotations},
            "spec": pod_spec,
        },
    }
    # The stable track and the tiers have no `replicas`: the HPA/KEDA owns it, and every
    # re-apply by the workflow would otherwise reset it to the rendered number.
    if track == "canary" and canary is not None and tier is None:
        spec["replicas"] = canary.replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, ctx.namespace, labels(ctx.name, component)),
        "spec": spec,
    }


def discovery_labels(
    ctx: RenderContext, track: str = "stable", tier: TierConfig | None = None
) -> dict[str, str]:
    """What the gateway reads from an engine Service's EndpointSlices (the names are
    `gateway/discovery.py`'s): the track, and a cheaper tier's name and variant."""
    found = {"modelship.io/model": ctx.model_label, "modelship.io/track": track}
    if tier is not None:
        found.update({"modelship.io/tier": tier.name, "modelship.io/variant": tier.variant})
    return found


def engine_service(
    ctx: RenderContext, track: str = "stable", tier: TierConfig | None = None
) -> Json:
    """Headless: its DNS name and EndpointSlices list the pods, which the gateway routes
    to one by one."""
    name, component = track_names(ctx, track) if tier is None else tier_names(ctx, tier)
    object_labels = {**labels(ctx.name, component), **discovery_labels(ctx, track, tier)}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(name, ctx.namespace, object_labels),
        "spec": {
            "type": "ClusterIP",
            "clusterIP": "None",
            "selector": selector(ctx.name, component),
            "ports": [
                {"name": "http", "port": ctx.port, "targetPort": "http", "protocol": "TCP"},
                # Same container port; a ServiceMonitor scrapes `metrics` at /metrics.
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def disruption_budget(ctx: RenderContext, name: str, component: str) -> Json:
    """Voluntary evictions (node drains) take at most `max_unavailable` pods at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(name, ctx.namespace, labels(ctx.name, component)),
        "spec": {
            "maxUnavailable": ctx.serving.max_unavailable,
            "selector": {"matchLabels": selector(ctx.name, component)},
        },
    }


def scaling_behavior(ctx: RenderContext) -> Json:
    """Scale up fast (double per 15 s), scale down slowly (one pod per minute)."""
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": ctx.serving.scale_up_stabilization_s,
            "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": ctx.serving.scale_down_stabilization_s,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
        },
    }


def pods_metric(metric: str, average: int) -> Json:
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": metric},
            "target": {"type": "AverageValue", "averageValue": str(average)},
        },
    }


def replica_bounds(ctx: RenderContext, tier: TierConfig | None = None) -> tuple[str, str, int, int]:
    """(name, component, min, max) of what an autoscaler scales: the stable engines or a
    tier's."""
    if tier is None:
        name, component = track_names(ctx, "stable")
        scaling = ctx.model.autoscale if ctx.model is not None else None
        if scaling is not None:  # another model's own bounds
            return name, component, scaling.min_replicas, scaling.max_replicas
        return name, component, ctx.serving.min_replicas, ctx.serving.max_replicas
    name, component = tier_names(ctx, tier)
    return name, component, tier.min_replicas, tier.max_replicas


def horizontal_autoscaler(ctx: RenderContext, tier: TierConfig | None = None) -> Json:
    """HPA on the engine's gauges, served to the custom metrics API by prometheus-adapter.

    Two metrics, the larger proposal wins: in-flight requests per replica (the concurrency
    target) and queued requests per replica (the engine is saturated when these grow).
    """
    name, component, min_replicas, max_replicas = replica_bounds(ctx, tier)
    prefix = ctx.metric_prefix
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(name, ctx.namespace, labels(ctx.name, component)),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": min_replicas,
            "maxReplicas": max_replicas,
            "metrics": [
                pods_metric(f"{prefix}num_requests_running", ctx.serving.target_concurrency),
                pods_metric(f"{prefix}num_requests_waiting", ctx.serving.target_waiting),
            ],
            "behavior": scaling_behavior(ctx),
        },
    }


def concurrency_query(ctx: RenderContext, pod_prefix: str) -> str:
    """Requests in flight (running + waiting) over all of one Deployment's engine pods."""
    match = f'namespace="{ctx.namespace}",pod=~"{pod_prefix}-[a-z0-9]+-[a-z0-9]+"'
    prefix = ctx.metric_prefix
    return (
        f"sum({prefix}num_requests_running{{{match}}})"
        f" + sum({prefix}num_requests_waiting{{{match}}})"
    )


def scaled_object(ctx: RenderContext, tier: TierConfig | None = None) -> Json:
    """KEDA: the same target, read from Prometheus directly (no metrics adapter needed)."""
    name, component, min_replicas, max_replicas = replica_bounds(ctx, tier)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": metadata(name, ctx.namespace, labels(ctx.name, component)),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": min_replicas,
            "maxReplicaCount": max_replicas,
            "pollingInterval": 15,
            "cooldownPeriod": max(ctx.serving.scale_down_stabilization_s, 60),
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": scaling_behavior(ctx)}},
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",  # the threshold is per replica
                    "metadata": {
                        "serverAddress": ctx.serving.prometheus_url,
                        "query": concurrency_query(ctx, name),
                        "threshold": str(ctx.serving.target_concurrency),
                    },
                }
            ],
        },
    }


def engine_service_names(ctx: RenderContext) -> list[str]:
    """The headless Services whose pods the gateway discovers: stable, canary, tiers, and
    each other model's (`models:`)."""
    names = [track_names(ctx, "stable")[0]]
    if ctx.serving.canary is not None:
        names.append(track_names(ctx, "canary")[0])
    names += [tier_names(ctx, tier)[0] for tier in ctx.config.gateway.variant_tiers]
    return names + [track_names(ctx.for_model(e), "stable")[0] for e in ctx.config.models]


def gateway_env(ctx: RenderContext) -> list[Json]:
    """Where the gateway finds the engines (their pods, from the Services' EndpointSlices in
    its own namespace), which engine they run, and the release plan it follows."""
    services = ",".join(engine_service_names(ctx))
    env = [
        {"name": "MODELSHIP_GATEWAY_DISCOVER_SERVICES", "value": services},
        {"name": "MODELSHIP_GATEWAY_ENGINE", "value": ctx.serving.engine},
        # Every gateway replica follows the model's release plan on the models volume (the
        # canary's weight, rollback, promotion: `modelship release` writes it), and stands
        # for the leader lease beside it: the leader alone judges the canary and probes for
        # drift, and writes its decisions to the plan (`fleet/plan_member.py`).
        {"name": "MODELSHIP_STORAGE", "value": DATA_ROOT},
        {"name": "MODELSHIP_GATEWAY_MODEL", "value": ctx.slug},
    ]
    # Every gateway replica appends the usage ledger to the models volume, a file of its
    # own (`modelship usage` on that volume sums them); `gateway.cost.USAGE_DIR` is "usage".
    usage = f"{DATA_ROOT}/models/{ctx.slug}/usage"
    env.append({"name": "MODELSHIP_GATEWAY_USAGE_DIR", "value": usage})
    return env + api_key_env(ctx)  # the key the engines require, when they do


def gateway_identity(ctx: RenderContext) -> list[Json]:
    """ServiceAccount + Role + RoleBinding the gateway runs as: it reads the engines'
    EndpointSlices, and Leases (the election of the one gateway that runs the fleet's
    single-writer work)."""
    name = f"{ctx.name}-{GATEWAY}"
    object_labels = labels(ctx.name, GATEWAY)
    rules = [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "verbs": ["get", "list", "watch", "create", "update", "patch"]},
    ]  # fmt: skip
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": metadata(name, ctx.namespace, object_labels),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(name, ctx.namespace, object_labels),
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(name, ctx.namespace, object_labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ctx.namespace}],
        },
    ]


def gateway_deployment(ctx: RenderContext) -> Json:
    gateway = ctx.serving.gateway
    name = f"{ctx.name}-{GATEWAY}"
    port = str(gateway.port)
    container: Json = {
        "name": GATEWAY,
        "image": ctx.deploy.image,
        "imagePullPolicy": ctx.deploy.image_pull_policy,
        "command": ["modelship"],
        "args": ["gateway", "--config", CONFIG_PATH, "--host", "0.0.0.0", "--port", port],
        "ports": [{"name": "http", "containerPort": gateway.port, "protocol": "TCP"}],
        "env": gateway_env(ctx),
        **probes("http", "/ready"),
        "lifecycle": prestop_sleep(ctx.serving.drain_delay_s),
        "resources": resources(gateway.resources, None),
        "volumeMounts": [config_mount(), data_mount(read_only=False)],  # the usage ledger
        "securityContext": non_root(),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, ctx.namespace, labels(ctx.name, GATEWAY)),
        "spec": {
            "replicas": gateway.replicas,
            "selector": {"matchLabels": selector(ctx.name, GATEWAY)},
            "template": {
                "metadata": {
                    "labels": selector(ctx.name, GATEWAY),
                    "annotations": prometheus_annotations(gateway.port),
                },
                "spec": {
                    "serviceAccountName": name,  # `gateway_identity`'s
                    "terminationGracePeriodSeconds": termination_grace_s(ctx),
                    "containers": [container],
                    "volumes": [config_volume(ctx), data_volume(ctx, read_only=False)],
                },
            },
        },
    }


def gateway_service(ctx: RenderContext) -> Json:
    """What clients call: the OpenAI API behind auth, limits and routing."""
    port = ctx.serving.gateway.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(f"{ctx.name}-{GATEWAY}", ctx.namespace, labels(ctx.name, GATEWAY)),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(ctx.name, GATEWAY),
            "ports": [
                {"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def deployment_serving(ctx: RenderContext) -> list[Json]:
    """Every object of deployment serving, in apply order."""
    engine, engine_component = track_names(ctx, "stable")
    objects = [
        engine_deployment(ctx),
        engine_service(ctx),
        disruption_budget(ctx, engine, engine_component),
        scaled_object(ctx) if ctx.serving.autoscaler == "keda" else horizontal_autoscaler(ctx),
    ]
    if ctx.serving.canary is not None:
        objects += [engine_deployment(ctx, "canary"), engine_service(ctx, "canary")]
    for tier in ctx.config.gateway.variant_tiers:
        autoscaler = scaled_object if ctx.serving.autoscaler == "keda" else horizontal_autoscaler
        objects += [
            engine_deployment(ctx, tier=tier),
            engine_service(ctx, tier=tier),
            disruption_budget(ctx, *tier_names(ctx, tier)),  # a drain keeps its minimum
            autoscaler(ctx, tier),
        ]
    for entry in ctx.config.models:  # each other model: its engines, scaled on their own
        model_ctx = ctx.for_model(entry)
        autoscaler = scaled_object if ctx.serving.autoscaler == "keda" else horizontal_autoscaler
        objects += [
            engine_deployment(model_ctx),
            engine_service(model_ctx),
            disruption_budget(model_ctx, *track_names(model_ctx, "stable")),
            autoscaler(model_ctx),
        ]
    objects += [
        *gateway_identity(ctx),
        gateway_deployment(ctx),
        gateway_service(ctx),
        disruption_budget(ctx, f"{ctx.name}-{GATEWAY}", GATEWAY),
    ]
    return objects
