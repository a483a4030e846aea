"""Render the config to Kubernetes YAML files, checked, and write them all or nothing.

cluster.yaml       Namespace, PVC, ConfigMap (pipeline.yaml), memo cache, API key Secret, RBAC
workflow.yaml      the Argo Workflow (generateName: submit it as often as you like)
serving.yaml       KServe InferenceService, or engine + gateway Deployments and friends
monitoring.yaml    the Grafana dashboard as a ConfigMap for Grafana's dashboard sidecar
grafana-dashboard.json  the same dashboard, to import by hand
helm-values.yaml   deployment serving only: values for deploy/helm/modelship
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelship.config import ModelshipConfig
from modelship.deploy.checks import check_objects
from modelship.deploy.cluster import cluster_objects
from modelship.deploy.context import RenderContext
from modelship.deploy.dashboard import dashboard_configmap, dashboard_json
from modelship.deploy.deployment import METRICS_PORT, deployment_serving
from modelship.deploy.helm_values import helm_values
from modelship.deploy.kserve import kserve_serving
from modelship.deploy.names import labels
from modelship.deploy.sizing import SizingError
from modelship.deploy.workflow import task_name, workflow
from modelship.deploy.yaml_text import dump_yaml, dump_yaml_all
from modelship.serve_options import VLLM_KV_CACHE_DTYPES

Json = dict[str, Any]
MARKER = ".modelship-render"
KNATIVE_RESERVED_PORTS = {
    8012,
    8013,
    8022,
    8112,
    9090,
    9091,
}  # tells a previous render (safe to replace) from other folders


class RenderError(ValueError):
    """The config cannot be rendered; each line names the field (or object) at fault."""


@dataclass(frozen=True)
class Rendered:
    files: dict[str, list[Json]]  # file name -> objects, in apply order
    helm_values: Json | None = field(default=None)

    @property
    def objects(self) -> list[Json]:
        return [obj for objects in self.files.values() for obj in objects]


def config_problems(config: ModelshipConfig) -> list[str]:
    """Combinations each section accepts alone but that cannot work together."""
    problems = []
    serving = config.deploy.serving
    if serving.gpu is not None and serving.engine == "ours" and config.serve.engine.device == "cpu":
        problems.append(
            "serve.engine.device: is 'cpu' but deploy.serving.gpu asks for GPUs; "
            "set serve.engine.device: cuda (or drop deploy.serving.gpu)"
        )
    ports = {"serve.port": config.serve.port, "deploy.serving.gateway.port": serving.gateway.port}
    for name, port in ports.items():
        if port == METRICS_PORT:
            problems.append(f"{name}: {port} is the Services' metrics port; choose another")
    kv_dtype = config.serve.engine.kv_cache_dtype
    if (
        serving.engine == "vllm"
        and kv_dtype not in (None, *VLLM_KV_CACHE_DTYPES)
        and kv_dtype != config.serve.engine.dtype
    ):
        problems.append(
            f"serve.engine.kv_cache_dtype: vLLM has no {kv_dtype} KV cache; use fp8 (or leave "
            "it unset for the model's dtype)"
        )
    if config.gateway.tenants and not (serving.api_key_secret or config.serve.api_key):
        # Replicas trust a tenant's cache namespace and input cap only with their key.
        problems.append(
            "gateway.tenants: the engines need an API key, or every tenant shares one prefix "
            "cache; set serve.api_key (or deploy.serving.api_key_secret)"
        )
    problems += shared_quota_problems(config)
    if serving.kind == "kserve" and config.gateway.tiers:
        problems.append(
            "gateway.tiers: rendered for deploy.serving.kind 'deployment' only (an engine "
            "Deployment per tier); KServe serves one variant"
        )
    if serving.kind == "kserve" and config.models:
        problems.append(
            "models: rendered for deploy.serving.kind 'deployment' only (an engine "
            "Deployment per model behind the gateway); KServe serves one model"
        )
    if serving.kind == "kserve" and config.serve.port in KNATIVE_RESERVED_PORTS:
        problems.append(f"serve.port: {config.serve.port} is reserved by Knative's queue-proxy")
    tasks = [task_name(variant) for variant in config.optimize.variants]
    if len(set(tasks)) != len(tasks):
        problems.append(f"optimize.variants: {tasks} repeat once made into task names")
    return problems


def shared_quota_problems(config: ModelshipConfig) -> list[str]:
    """Tenant quotas kept in each gateway process would multiply by the gateway replicas:
    refused unless the replicas share a store (`gateway.state`). Dividing the quotas by the
    replica count instead would be wrong whenever traffic does not split evenly (a client's
    keep-alive connection stays on one pod) and whenever the replica count changes."""
    replicas = config.deploy.serving.gateway.replicas
    if config.deploy.serving.kind != "deployment" or replicas < 2 or config.gateway.state:
        return []
    quotas = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
    limited = [t.name for t in config.gateway.tenants if any(getattr(t, q) for q in quotas)]
    if not limited:
        return []
    return [
        f"gateway.state: tenants {', '.join(map(repr, limited))} set requests_per_minute, "
        f"tokens_per_minute or max_concurrent, and deploy.serving.gateway.replicas is "
        f"{replicas}: kept in each gateway, every tenant would get {replicas} times its "
        "quotas. Set gateway.state: redis://HOST:PORT/DB (a Redis every gateway replica "
        "reaches, shared by them), or deploy.serving.gateway.replicas: 1"
    ]


def render(config: ModelshipConfig) -> Rendered:
    """Every object for `config`; raises RenderError before anything could be written."""
    problems = config_problems(config)
    if problems:
        raise RenderError("\n".join(problems))
    try:
        ctx = RenderContext.from_config(config)
    except SizingError as exc:
        raise RenderError(str(exc)) from exc
    serving = kserve_serving(ctx) if ctx.serving.kind == "kserve" else deployment_serving(ctx)
    rendered = Rendered(
        files={
            "cluster.yaml": cluster_objects(ctx),
            "workflow.yaml": [workflow(ctx, serving)],
            "serving.yaml": serving,
            "monitoring.yaml": [
                dashboard_configmap(ctx.name, ctx.namespace, labels(ctx.name, "monitoring"))
            ],
        },
        helm_values=helm_values(ctx) if ctx.serving.kind == "deployment" else None,
    )
    errors = check_objects(rendered.objects)
    if errors:
        raise RenderError("\n".join(str(error) for error in errors))
    return rendered


def dump_objects(objects: list[Json]) -> str:
    return dump_yaml_all(objects)


def write_rendered(rendered: Rendered, out: Path) -> list[Path]:
    """Write into a temporary sibling, then rename it to `out`: never a half-written folder.

    An existing `out` is replaced only if it is empty or a previous render (has the marker),
    so a mistyped `--out .` cannot swap away a working directory.
    """
    out = Path(out)
    if out.exists() and not _replaceable(out):
        raise RenderError(
            f"{out}: exists and is not a previous render; choose a new or empty folder"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        for name, objects in rendered.files.items():
            (tmp / name).write_text(dump_objects(objects))
        if rendered.helm_values is not None:
            (tmp / "helm-values.yaml").write_text(dump_yaml(rendered.helm_values))
        (tmp / "grafana-dashboard.json").write_text(dashboard_json())
        (tmp / MARKER).write_text("written by `modelship deploy render`; safe to replace\n")
        _swap_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(path for path in out.iterdir() if path.name != MARKER)


def _replaceable(out: Path) -> bool:
    return out.is_dir() and ((out / MARKER).is_file() or not any(out.iterdir()))


def _swap_into_place(tmp: Path, out: Path) -> None:
    if not out.exists():
        tmp.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        old.rename(out)  # put the previous render back
        raise
    shutil.rmtree(old, ignore_errors=True)
