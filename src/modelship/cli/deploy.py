"""`modelship deploy ...`: render the pipeline and the service for Kubernetes, check a render."""

from __future__ import annotations

from collections import Counter
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from modelship.cli.common import CONFIG_EXIT_CODE, fail
from modelship.config import ConfigError, ModelshipConfig

deploy_app = typer.Typer(
    help="Kubernetes: render the Argo Workflow and the serving objects, validate a render.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class ServingKind(StrEnum):
    kserve = "kserve"
    deployment = "deployment"


class Autoscaler(StrEnum):
    hpa = "hpa"
    keda = "keda"


def load_config(
    path: Path | None, serving: ServingKind | None, autoscaler: Autoscaler | None
) -> ModelshipConfig:
    """pipeline.yaml with the command line's choices applied, validated as one config."""
    config = ModelshipConfig.load(path)
    if serving is None and autoscaler is None:
        return config
    data: dict[str, Any] = config.model_dump(mode="json", exclude_unset=True)
    section = data.setdefault("deploy", {}).setdefault("serving", {})
    if serving is not None:
        section["kind"] = serving.value
    if autoscaler is not None:
        section["autoscaler"] = autoscaler.value
    return ModelshipConfig.from_dict(data, str(path) if path else "config")


@deploy_app.command()
def render(
    out: Annotated[Path, typer.Option("--out", help="Folder to write (replaced whole).")],
    config: Annotated[
        Path | None, typer.Option("--config", help="pipeline.yaml (default: all defaults).")
    ] = None,
    serving: Annotated[
        ServingKind | None, typer.Option(help="Override deploy.serving.kind.")
    ] = None,
    autoscaler: Annotated[
        Autoscaler | None, typer.Option(help="Override deploy.serving.autoscaler.")
    ] = None,
) -> None:
    """Write cluster.yaml, workflow.yaml, serving.yaml (and helm-values.yaml) into OUT."""
    from modelship.deploy.render import RenderError, write_rendered
    from modelship.deploy.render import render as render_objects

    try:
        rendered = render_objects(load_config(config, serving, autoscaler))
        paths = write_rendered(rendered, out)
    except (ConfigError, RenderError) as exc:  # a broken or impossible configuration
        fail(str(exc), CONFIG_EXIT_CODE)
    except OSError as exc:
        fail(str(exc))
    for path in paths:
        objects = rendered.files.get(path.name, [])
        kinds = Counter(obj["kind"] for obj in objects)
        summary = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        typer.echo(f"{path}" + (f": {summary}" if summary else ""))


def read_render(folder: Path) -> list[dict[str, Any]]:
    """Every object of a render folder's manifests (helm-values.yaml is not a manifest)."""
    objects = []
    for path in sorted(folder.glob("*.yaml")):
        if path.name == "helm-values.yaml":
            continue
        objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return objects


@deploy_app.command()
def validate(
    folder: Annotated[Path, typer.Argument(help="A folder written by `deploy render`.")],
    schemas: Annotated[
        Path | None,
        typer.Option(help="shared/k8s-schemas (default: beside the repository)."),
    ] = None,
    kubernetes_version: Annotated[str | None, typer.Option(help="Schema version.")] = None,
) -> None:
    """Check a render offline: strict schemas (core and custom resources) and cross-checks."""
    from modelship.deploy.checks import check_objects
    from modelship.deploy.validate import (
        KUBERNETES_VERSION,
        ValidationUnavailable,
        validate_objects,
    )

    if not folder.is_dir():
        fail(f"{folder}: no such folder")
    objects = read_render(folder)
    version = kubernetes_version or KUBERNETES_VERSION
    try:
        problems = validate_objects(objects, schemas, version)
    except ValidationUnavailable as exc:
        fail(str(exc))
    problems += [str(error) for error in check_objects(objects)]
    for problem in problems:
        typer.echo(problem, err=True)
    kinds = Counter(obj["kind"] for obj in objects)
    summary = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
    typer.echo(f"{len(objects)} objects ({summary}), Kubernetes {version}: {len(problems)} errors")
    if problems:
        raise typer.Exit(1)
