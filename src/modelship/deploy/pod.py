"""Pieces of pod specs shared by the Workflow, the InferenceService and the Deployments."""

from __future__ import annotations

import math
from typing import Any

from modelship.deploy.config import GpuConfig, Resources
from modelship.deploy.context import RenderContext
from modelship.deploy.names import CONFIG_DIR, DATA_ROOT, model_path, variant_path
from modelship.serve_options import ServeOptions

DATA_VOLUME = "data"
CONFIG_VOLUME = "config"
RUN_AS_USER = 10001  # the non-root user of the Dockerfile
API_KEY_ENV = "MODELSHIP_API_KEY"
# Model loading happens before the port opens: allow this long before liveness applies.
STARTUP_PERIOD_S = 10
STARTUP_FAILURES = 90

Json = dict[str, Any]


def resources(spec: Resources, gpu: GpuConfig | None) -> Json:
    """Requests/limits; a GPU is a limit only (Kubernetes sets the request equal to it)."""
    limits = dict(spec.limits)
    if gpu is not None:
        limits[gpu.resource] = str(gpu.count)
    out: Json = {}
    if spec.requests:
        out["requests"] = dict(spec.requests)
    if limits:
        out["limits"] = limits
    return out


def gpu_scheduling(gpu: GpuConfig | None) -> Json:
    """Node affinity and tolerations that put a pod on the GPU pool (empty without a GPU)."""
    if gpu is None:
        return {}
    out: Json = {}
    if gpu.node_labels:
        expressions = [
            {"key": key, "operator": "In", "values": [value]}
            for key, value in sorted(gpu.node_labels.items())
        ]
        out["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": expressions}]
                }
            }
        }
    if gpu.tolerations:
        out["tolerations"] = [t.model_dump(exclude_none=True) for t in gpu.tolerations]
    return out


def data_volume(ctx: RenderContext, *, read_only: bool) -> Json:
    claim: Json = {"claimName": ctx.pvc_name}
    if read_only:
        claim["readOnly"] = True
    return {"name": DATA_VOLUME, "persistentVolumeClaim": claim}


def data_mount(*, read_only: bool) -> Json:
    mount: Json = {"name": DATA_VOLUME, "mountPath": DATA_ROOT}
    if read_only:
        mount["readOnly"] = True
    return mount


def config_volume(ctx: RenderContext) -> Json:
    return {"name": CONFIG_VOLUME, "configMap": {"name": ctx.config_map_name}}


def config_mount() -> Json:
    return {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True}


def http_get(path: str, port: int | str, *, period_s: int, failures: int) -> Json:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period_s,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }


def probes(port: int | str, ready_path: str) -> Json:
    """Startup and liveness on /health, readiness on `ready_path` (503 while draining)."""
    return {
        "startupProbe": http_get(
            "/health", port, period_s=STARTUP_PERIOD_S, failures=STARTUP_FAILURES
        ),
        "livenessProbe": http_get("/health", port, period_s=10, failures=3),
        "readinessProbe": http_get(ready_path, port, period_s=5, failures=2),
    }


def prestop_sleep(seconds: int) -> Json:
    """Keep serving while endpoint removal reaches every proxy; SIGTERM then drains."""
    return {"preStop": {"exec": {"command": ["sleep", str(seconds)]}}}


def termination_grace_s(ctx: RenderContext) -> int:
    """preStop + the server's own drain (serve.grace_period_s) + room to exit."""
    return ctx.serving.drain_delay_s + math.ceil(ctx.config.serve.grace_period_s) + 15


def non_root() -> Json:
    """Container security context for our image.

    Only fields Knative admits without feature flags (its default allowlist has no
    runAsGroup); the image's `USER 10001:10001` sets the group.
    """
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def api_key_env(ctx: RenderContext, variable: str = API_KEY_ENV) -> list[Json]:
    secret = ctx.api_key_secret
    if secret is None:
        return []
    ref = {"secretKeyRef": {"name": secret, "key": "api-key"}}
    return [{"name": variable, "valueFrom": ref}]


# Set by the Helm chart from values of its own, around `engine.flags` (`engine_flags`).
CHART_FLAGS = ("served_model_name", "grace_period_s", "stall_timeout_s", "variant")


def engine_flags(ctx: RenderContext) -> list[str]:
    """Engine options after the model/name/address flags (the chart's `engine.flags`): our
    replicas get what `modelship up` gives its own (`ModelshipConfig.replica_options`), less
    what the chart sets itself; vLLM its spelling of them (`ServeOptions.vllm_args`).
    Adapter folders are as the pod sees them (e.g. on the data volume)."""
    options = replica_options(ctx)
    if ctx.serving.engine == "ours":
        return options.replica_args(exclude=CHART_FLAGS)
    flags = options.vllm_args()
    gpu = ctx.serving.gpu
    if gpu is not None and gpu.count > 1:
        flags += ["--tensor-parallel-size", str(gpu.count)]
    return flags


def replica_options(ctx: RenderContext, **overrides: Any) -> ServeOptions:
    """The config's replica options, with one tensor-parallel rank per GPU the pod gets
    (`ctx.serving` raises the count to what the model needs), and a mixture-of-experts
    model on several ranks sharding its experts (`--expert-parallel`)."""
    options = ctx.config.replica_options(**overrides)
    gpu = ctx.serving.gpu
    update: dict[str, Any] = {}
    if gpu is not None and gpu.count > options.engine.tensor_parallel_size:
        update["tensor_parallel_size"] = gpu.count
    ranks = update.get("tensor_parallel_size", options.engine.tensor_parallel_size)
    if ctx.size is not None and ctx.size.mixture_of_experts and ranks > 1:
        update["expert_parallel"] = True
    if update:
        engine = options.engine.model_copy(update=update)
        options = options.model_copy(update={"engine": engine})
    return options


def engine_args(
    ctx: RenderContext, model_dir: str, variant: str | None = None
) -> tuple[list[str], list[str]]:
    """(command, args) of the engine container for the configured engine."""
    if ctx.serving.engine == "vllm":
        args = [
            "--model", model_dir,
            "--served-model-name", ctx.served_model_name,
            "--host", "0.0.0.0",
            "--port", str(ctx.port),
            *engine_flags(ctx),
        ]  # fmt: skip
        return ["vllm", "serve"], args
    # `variant` is the label a tier's metrics carry
    options = replica_options(ctx, served_model_name=ctx.served_model_name, variant=variant)
    args = ["serve", model_dir, "--host", "0.0.0.0", "--port", str(ctx.port),
            *options.replica_args()]  # fmt: skip
    return ["modelship"], args


def engine_container(
    ctx: RenderContext,
    *,
    name: str,
    release: int | None,
    port_name: str | None,
    variant: str | None = None,
) -> Json:
    """The engine container: our `modelship serve` or vLLM, the model read-only from the PVC:
    the release's (`production` or a pinned one), or with `variant` that optimized variant
    (a cheaper tier's).

    `port_name` None leaves the probes on the number (Knative names its single port itself).
    """
    if variant is None:
        model_dir = model_path(ctx.slug, release)
    else:
        model_dir = variant_path(ctx.slug, variant)
    command, args = engine_args(ctx, model_dir, variant)
    vllm = ctx.serving.engine == "vllm"
    port_ref: int | str = port_name or ctx.port
    container: Json = {
        "name": name,
        "image": ctx.serving.vllm_image if vllm else ctx.deploy.image,
        "imagePullPolicy": ctx.deploy.image_pull_policy,
        "command": command,
        "args": args,
        "ports": [{"name": port_name or "http1", "containerPort": ctx.port, "protocol": "TCP"}],
        # vLLM has no /ready: its port opens once the model is loaded, so /health suffices.
        **probes(port_ref, "/health" if vllm else "/ready"),
        "resources": resources(ctx.serving.resources, ctx.serving.gpu),
        "volumeMounts": [data_mount(read_only=True)],
    }
    env = api_key_env(ctx, "VLLM_API_KEY" if vllm else API_KEY_ENV)
    if env:
        container["env"] = env
    if not vllm:  # the vLLM image runs as root
        container["securityContext"] = non_root()
    return container


def prometheus_annotations(port: int) -> dict[str, str]:
    """For annotation-based scraping; a ServiceMonitor uses the Service's `metrics` port."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
