"""`modelship list`: the models in storage, their releases and what serves them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Annotated

import typer

from modelship.cli.common import (
    CONFIG_EXIT_CODE,
    ConfigOption,
    ConfigStorageOption,
    console,
    fail,
    load_config,
)
from modelship.storage import Storage

app = typer.Typer()


@dataclass(frozen=True)
class ModelRow:
    """One model as `list` shows it (and `--json` writes it)."""

    model: str
    variants: list[str]  # optimized
    releases: list[int]
    production: int | None
    production_variant: str | None
    size_mb: float | None  # the production release's, else the base's
    canary: str | None  # "release 3 at 10%"
    serving: str | None  # the gateway URL of a live `modelship up`


@app.command("list")
def list_models(
    as_json: Annotated[bool, typer.Option("--json", help="The rows as JSON.")] = False,
    config_path: ConfigOption = None,
    storage: ConfigStorageOption = None,
) -> None:
    """The models in storage: optimized variants, releases, production, what serves them."""
    from rich.table import Table

    config = load_config(config_path, storage=storage)
    store = Storage(config.storage)
    if not store.root.is_dir():
        fail(
            f"{store.root}: no such storage folder (pass --storage PATH or set "
            "MODELSHIP_STORAGE; `modelship run` creates it)",
            CONFIG_EXIT_CODE,
        )
    rows = [model_row(store, slug) for slug in store.models()]
    if as_json:
        typer.echo(json.dumps([asdict(row) for row in rows], indent=2))
        return
    if not rows:
        console.print(f"no model under {store.root} yet (`modelship run` makes the demo's)")
        return
    table = Table("model", "variants", "releases", "production", "size", "serving", box=None)
    for row in rows:
        production = "none"
        if row.production is not None:
            production = f"release {row.production} ({row.production_variant or '?'})"
        if row.canary:
            production += f", canary {row.canary}"
        table.add_row(
            row.model,
            ", ".join(row.variants) or "-",
            ", ".join(map(str, row.releases)) or "-",
            production,
            _size(row.size_mb),
            row.serving or "-",
        )
    console.print(table)


def _size(size_mb: float | None) -> str:
    if size_mb is None:
        return "-"
    return f"{size_mb / 1000:.1f} GB" if size_mb >= 1000 else f"{size_mb:.1f} MB"


def model_row(storage: Storage, slug: str) -> ModelRow:
    """What storage says of `slug`: files only (manifests, links, the traffic plan and the
    serving record), no model loaded."""
    from modelship.fleet.serving_record import read_serving
    from modelship.pipeline.errors import PipelineError
    from modelship.release.traffic import read_traffic
    from modelship.storage import StorageError, read_manifest

    optimized = storage.model_dir(slug) / "optimized"
    # staging and replaced folders (`.tmp-*`, `.old-*`) are no variants
    found = optimized.iterdir() if optimized.is_dir() else ()
    variants = sorted(p.name for p in found if p.is_dir() and not p.name.startswith("."))
    production = storage.production_release(slug)
    variant = size_mb = None
    folder = storage.base_dir(slug) if production is None else storage.release_dir(slug, production)
    try:
        manifest = read_manifest(folder)
        size_mb = manifest.total_bytes / 1e6
        if production is not None:
            variant = manifest.extra.get("variant")
    except StorageError:  # no base yet, or a release being replaced
        pass
    try:
        plan = read_traffic(storage, slug)
        canary = (
            None
            if plan.canary is None
            else (f"release {plan.canary.release} at {plan.canary.weight}%")
        )
    except PipelineError:
        canary = "unreadable traffic.json"
    serving = read_serving(storage, slug)
    return ModelRow(
        model=slug,
        variants=variants,
        releases=storage.releases(slug),
        production=production,
        production_variant=variant,
        size_mb=size_mb,
        canary=canary,
        serving=None if serving is None else f"{serving.url} (pid {serving.pid})",
    )
