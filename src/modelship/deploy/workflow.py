"""The pipeline as an Argo Workflow: acquire -> optimize (one task per variant) -> select -> deploy.

Every step runs our image against the PVC mounted at /data, exactly as the local run does
against its storage root, so the stages' contracts (manifests, atomic renames, the
`production` symlink) hold unchanged. The final deploy step applies the serving objects
with Argo resource templates (`kubectl apply` in Argo's executor), stamping pods that serve
`production` with the workflow's name so they restart onto the release select just published.
"""

from __future__ import annotations

import json
import re
from typing import Any

from modelship.deploy.config import StepConfig
from modelship.deploy.context import RenderContext
from modelship.deploy.names import CONFIG_PATH, DATA_ROOT, labels
from modelship.deploy.pod import (
    RUN_AS_USER,
    config_mount,
    config_volume,
    data_mount,
    data_volume,
    gpu_scheduling,
    non_root,
    resources,
)

Json = dict[str, Any]
ROLLOUT_ANNOTATION = "modelship.io/rollout"


def workflow(ctx: RenderContext, serving_objects: list[Json]) -> Json:
    """The Workflow object; submit it with `argo submit` or `kubectl create` (generateName)."""
    wf_labels = labels(ctx.name, "pipeline")
    meta = {"generateName": f"{ctx.name}-pipeline-", "namespace": ctx.namespace}
    meta["labels"] = dict(wf_labels)
    variants = ctx.config.optimize.variants
    deploy_step = ctx.deploy.workflow.deploy_step
    templates = [
        dag(variants, deploy_step=deploy_step),
        *acquire_templates(ctx),
        optimize_template(ctx),
        select_template(ctx),
    ]
    if deploy_step:
        templates += [deploy_template(serving_objects), apply_template(ctx)]
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": meta,
        "spec": {
            "entrypoint": "pipeline",
            "serviceAccountName": ctx.pipeline_service_account,
            "parallelism": ctx.deploy.workflow.parallelism,
            "podGC": {"strategy": "OnWorkflowSuccess"},
            "podMetadata": {"labels": dict(wf_labels)},
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": RUN_AS_USER,
                "runAsGroup": RUN_AS_USER,
                "fsGroup": RUN_AS_USER,  # the PVC is writable by the non-root user
            },
            "volumes": [data_volume(ctx, read_only=False), config_volume(ctx)],
            "templates": templates,
        },
    }


def task_name(variant: str) -> str:
    """DAG task names allow letters, digits and '-' only."""
    return "optimize-" + re.sub(r"[^a-zA-Z0-9-]+", "-", variant).strip("-")


def dag(variants: list[str], *, deploy_step: bool) -> Json:
    optimize_tasks = [
        {
            "name": task_name(variant),
            "template": "optimize",
            "dependencies": ["acquire"],
            "arguments": {"parameters": [{"name": "variant", "value": variant}]},
        }
        for variant in variants
    ]
    tasks = [
        {"name": "acquire", "template": "acquire"},
        *optimize_tasks,
        {
            "name": "select",
            "template": "select",
            "dependencies": [task["name"] for task in optimize_tasks],
        },
    ]
    if deploy_step:
        tasks.append({"name": "deploy", "template": "deploy", "dependencies": ["select"]})
    return {"name": "pipeline", "dag": {"tasks": tasks}}


def go_duration(seconds: float) -> str:
    return f"{int(seconds)}s" if float(seconds).is_integer() else f"{round(seconds * 1000)}ms"


def retry_strategy(ctx: RenderContext) -> Json | None:
    """Retry pod-level errors and the transient exit codes only, with exponential backoff.

    `retryPolicy: Always` hands every failure to the expression, which lets through Argo's
    `Error` status (evicted, node lost, pod deleted) and the configured exit codes; a bad
    input (exit 1) fails the step at once instead of burning retries.
    """
    retries = ctx.config.retries
    if retries.max_attempts <= 1:
        return None
    checks = ["lastRetry.status == 'Error'"]
    checks += [
        f"asInt(lastRetry.exitCode) == {code}" for code in ctx.deploy.workflow.transient_exit_codes
    ]
    return {
        "limit": retries.max_attempts - 1,  # retries after the first attempt
        "retryPolicy": "Always",
        "expression": " || ".join(checks),
        "backoff": {
            "duration": go_duration(retries.backoff_s),
            "factor": 2,
            "cap": go_duration(max(retries.max_backoff_s, retries.backoff_s)),
        },
    }


def stage_template(
    ctx: RenderContext, name: str, args: list[str], step: StepConfig, *, with_config: bool
) -> Json:
    """A container step running `modelship <args>` on the PVC, with its resources and GPUs."""
    mounts = [data_mount(read_only=False)]
    if with_config:
        mounts.append(config_mount())
    template: Json = {
        "name": name,
        "container": {
            "name": "main",
            "image": ctx.deploy.image,
            "imagePullPolicy": ctx.deploy.image_pull_policy,
            "command": ["modelship"],
            "args": args,
            "resources": resources(step.resources, step.gpu),
            "volumeMounts": mounts,
            "securityContext": non_root(),
        },
        **gpu_scheduling(step.gpu),
    }
    strategy = retry_strategy(ctx)
    if strategy is not None:
        template["retryStrategy"] = strategy
    return template


def memo_key(ctx: RenderContext) -> str:
    """model + revision, in the characters a ConfigMap key allows."""
    revision = ctx.config.revision or "default"
    return re.sub(r"[^-._a-zA-Z0-9]+", "-", f"acquire.{ctx.slug}.{revision}")


def acquire_templates(ctx: RenderContext) -> list[Json]:
    """`acquire` (memoized) wraps `acquire-run` (the container, retried).

    The memo sits on a parent steps template because Argo does not record a memo entry for
    a template that also retries (argo-workflows#10426); a parent's memo covers its steps.
    """
    args = ["acquire", ctx.config.source]
    if ctx.config.revision:
        args += ["--revision", ctx.config.revision]
    args += ["--name", ctx.slug, "--storage", DATA_ROOT]
    run = stage_template(ctx, "acquire-run", args, ctx.deploy.workflow.acquire, with_config=False)
    # What is memoized: the base's manifest (source, revision, sha256 of every file).
    manifest = f"{DATA_ROOT}/models/{ctx.slug}/base/manifest.json"
    run["outputs"] = {"parameters": [{"name": "manifest", "valueFrom": {"path": manifest}}]}
    memoized = {
        "name": "acquire",
        "steps": [[{"name": "run", "template": "acquire-run"}]],
        "memoize": {
            "key": memo_key(ctx),
            "maxAge": ctx.deploy.workflow.memoize_max_age,
            "cache": {"configMap": {"name": ctx.memo_cache_name}},
        },
        "outputs": {
            "parameters": [
                {
                    "name": "manifest",
                    "valueFrom": {"parameter": "{{steps.run.outputs.parameters.manifest}}"},
                }
            ]
        },
    }
    return [memoized, run]


def optimize_template(ctx: RenderContext) -> Json:
    args = [
        "optimize",
        "--config", CONFIG_PATH,
        "--storage", DATA_ROOT,
        "--variant", "{{inputs.parameters.variant}}",
    ]  # fmt: skip
    template = stage_template(ctx, "optimize", args, ctx.deploy.workflow.optimize, with_config=True)
    template["inputs"] = {"parameters": [{"name": "variant"}]}
    return template


def select_template(ctx: RenderContext) -> Json:
    args = ["select", "--config", CONFIG_PATH, "--storage", DATA_ROOT]
    return stage_template(ctx, "select", args, ctx.deploy.workflow.select, with_config=True)


def with_rollout_stamp(obj: Json) -> Json:
    """A copy whose pods change when the workflow runs, so they reload `production`.

    Only objects serving `production` are stamped: a pinned release (canary, rollback)
    does not change when select publishes a new one.
    """
    stamped = json.loads(json.dumps(obj))
    kind = stamped["kind"]
    if kind == "Deployment":
        template = stamped["spec"]["template"]
        if template["metadata"].get("annotations", {}).get("modelship.io/serves") != "production":
            return stamped
        template["metadata"]["annotations"][ROLLOUT_ANNOTATION] = "{{workflow.name}}"
    elif kind == "InferenceService":
        predictor = stamped["spec"]["predictor"]
        if predictor.get("annotations", {}).get("modelship.io/serves") == "production":
            predictor["annotations"][ROLLOUT_ANNOTATION] = "{{workflow.name}}"
    return stamped


def deploy_template(serving_objects: list[Json]) -> Json:
    """Apply every serving object in parallel (one `apply` step each)."""
    steps = [
        {
            "name": f"apply-{obj['kind'].lower()}-{obj['metadata']['name']}",
            "template": "apply",
            "arguments": {
                "parameters": [
                    {
                        "name": "manifest",
                        "value": json.dumps(with_rollout_stamp(obj), sort_keys=True),
                    }
                ]
            },
        }
        for obj in serving_objects
    ]
    return {"name": "deploy", "steps": [steps]}


def apply_template(ctx: RenderContext) -> Json:
    template: Json = {
        "name": "apply",
        "inputs": {"parameters": [{"name": "manifest"}]},
        "resource": {"action": "apply", "manifest": "{{inputs.parameters.manifest}}"},
    }
    strategy = retry_strategy(ctx)
    if strategy is not None:
        template["retryStrategy"] = strategy
    return template
