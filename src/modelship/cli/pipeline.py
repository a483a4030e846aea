"""Pipeline commands: acquire, verify, optimize, select, rollback, status, run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from modelship.cli.common import (
    ConfigOption,
    ConfigStorageOption,
    ModelOption,
    StorageOption,
    console,
    err_console,
    exit_code,
    fail,
    load_config,
    model_context,
)
from modelship.pipeline.errors import PipelineError
from modelship.progress import make_progress
from modelship.storage import MANIFEST_NAME, STORAGE_ENV, Storage, StorageError

app = typer.Typer()


@app.command()
def acquire(
    source: Annotated[
        str, typer.Argument(help="Hub repo id, local model folder, .gguf file, or 'demo'.")
    ],
    revision: Annotated[
        str | None, typer.Option(help="Hub branch, tag or commit sha (default: main).")
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Model folder name under models/ (default: derived).")
    ] = None,
    refresh: Annotated[
        bool, typer.Option(help="Re-resolve a Hub branch or tag instead of the memoized one.")
    ] = False,
    storage: StorageOption = Path("./modelship-data"),
) -> None:
    """Acquire a model into STORAGE/models/<name>/base (memoized, checksummed)."""
    from modelship.pipeline.acquire import acquire as run_acquire

    try:
        with make_progress(err_console) as progress:
            result = run_acquire(
                source, Storage(storage), revision, name=name, refresh=refresh, progress=progress
            )
    except (PipelineError, StorageError) as exc:
        fail(str(exc), exit_code(exc))
        return
    manifest = result.manifest
    how = "already acquired (memoized)" if result.memoized else "acquired"
    console.print(f"[green]{how}[/] {manifest.source} in {result.seconds:.2f}s")
    if manifest.revision:
        console.print(f"revision: {manifest.revision}")
    size_mb = manifest.total_bytes / 1e6
    console.print(f"{len(manifest.files)} files, {size_mb:.1f} MB, sha256 in manifest.json")
    console.print(str(result.path))


@app.command()
def verify(
    artifact: Annotated[Path, typer.Argument(help="An artifact folder (has manifest.json).")],
    full: Annotated[bool, typer.Option(help="Recompute sha256 of every file.")] = False,
    rebuild: Annotated[
        bool,
        typer.Option(
            help="An optimized variant: make it again from its recorded inputs and compare "
            "the bytes (exit 1 if any file differs)."
        ),
    ] = False,
) -> None:
    """Check an artifact folder against its manifest."""
    from modelship.storage import verify_artifact

    if not artifact.is_dir():
        fail(f"{artifact}: no such folder (an artifact is a folder like STORAGE/models/SLUG/base)")
    if rebuild:
        _verify_rebuild(artifact)
        return
    try:
        manifest = verify_artifact(artifact, full=full)
    except StorageError as exc:
        fail(str(exc), exit_code(exc))
        return
    mode = "sha256" if full else "sizes"
    console.print(f"[green]ok[/] {artifact}: {len(manifest.files)} files match ({mode})")


def _verify_rebuild(artifact: Path) -> None:
    from modelship.pipeline.optimize.rebuild import rebuild

    try:
        rebuilt = rebuild(artifact)
    except (PipelineError, StorageError) as exc:
        fail(str(exc), exit_code(exc))
        return
    if not rebuilt.identical:
        fail(
            f"{artifact}: made again, {len(rebuilt.differing)} of {rebuilt.num_files} files "
            f"differ: {', '.join(rebuilt.differing)}",
            1,
        )
        return
    console.print(
        f"[green]ok[/] {artifact}: made again in {rebuilt.seconds:.1f}s, all "
        f"{rebuilt.num_files} files byte-identical"
    )


@app.command()
def optimize(
    config_path: ConfigOption = None,
    variant: Annotated[
        list[str] | None, typer.Option("--variant", help="Only this variant (repeatable).")
    ] = None,
    max_parallel: Annotated[int | None, typer.Option(help="Variants made at once.")] = None,
    model: ModelOption = None,
    storage: ConfigStorageOption = None,
) -> None:
    """Make optimized variants (fp16, awq, gptq...) of an acquired model, in parallel."""
    from modelship.pipeline.optimize import optimize as run_optimize

    config, store, slug = model_context(config_path, storage, model)
    if not (store.base_dir(slug) / MANIFEST_NAME).is_file():
        fail(f"{slug} has no base model under {store.root} to optimize "
             f"(`modelship acquire SOURCE --name {slug}` first)")  # fmt: skip
    variants = variant or config.optimize.variants
    try:
        results = run_optimize(
            store,
            slug,
            variants,
            max_parallel=max_parallel or config.optimize.max_parallel,
            overrides=config.optimize.recipes,
        )
    except (PipelineError, StorageError) as exc:
        fail(str(exc), exit_code(exc))
        return
    for result in results:
        how = "memoized" if result.memoized else f"made in {result.seconds:.1f}s"
        console.print(f"[green]{result.variant}[/] {how}: {result.path}")


@app.command()
def select(
    config_path: ConfigOption = None,
    model: ModelOption = None,
    storage: ConfigStorageOption = None,
) -> None:
    """Measure every variant, gate, score, publish the winner as a release (production)."""
    from modelship.pipeline.select.runner import select as run_select

    config, store, slug = model_context(config_path, storage, model)
    try:
        result = run_select(store, slug, config, log=err_console.print)
    except (PipelineError, StorageError) as exc:
        fail(str(exc), exit_code(exc))
        return
    _print_selection(result, store, slug)


def _print_selection(result, storage: Storage, slug: str) -> None:
    from rich.table import Table

    table = Table("variant", "passed", "score", "why not")
    for score in result.scores:
        why = "; ".join(score.reasons)
        table.add_row(score.variant, "yes" if score.passed else "no", f"{score.score:.3f}", why)
    console.print(table)
    how = "new release" if result.new_release else "unchanged"
    release_dir = storage.release_dir(slug, result.release)
    console.print(f"[green]winner {result.winner}[/]: release {result.release} ({how})")
    console.print(f"report: {release_dir / 'report.md'}")


@app.command()
def rollback(
    to: Annotated[int | None, typer.Option(help="Release number (default: the previous).")] = None,
    config_path: ConfigOption = None,
    model: ModelOption = None,
    storage: ConfigStorageOption = None,
) -> None:
    """Point production at an earlier release (atomically)."""
    from modelship.release.traffic import record_event
    from modelship.release.traffic import rollback as run_rollback

    _, store, slug = model_context(config_path, storage, model)
    try:
        before, after = run_rollback(store, slug, to)
        event = {"action": "production", "release": after, "previous": before}
        record_event(store, slug, event | {"reason": "modelship rollback"})
    except (PipelineError, StorageError) as exc:
        fail(str(exc), exit_code(exc))
        return
    console.print(f"production: release {before} -> release {after}")


@app.command()
def status(
    config_path: ConfigOption = None,
    model: ModelOption = None,
    storage: ConfigStorageOption = None,
) -> None:
    """Each pipeline step's state and timing, the releases and which one is production."""
    from rich.table import Table

    from modelship.pipeline.dag import read_status
    from modelship.pipeline.run import run_dir

    _, store, slug = model_context(config_path, storage, model)
    state = read_status(run_dir(store, slug))
    if state is None:
        console.print(f"no pipeline run recorded for {slug} under {store.root}")
    else:
        console.print(f"pipeline {state['state']} (started {state['started_at']})")
        if state["state"] == "interrupted":
            console.print(
                f"  the run (pid {state['pid']}) is gone: `modelship run` resumes it, "
                "redoing only unfinished steps"
            )
        table = Table("step", "state", "attempts", "seconds", "memoized", "detail")
        for name, step in state["steps"].items():
            facts = step.get("facts") or {}
            detail = step.get("error") or facts.get("winner") or ""
            seconds = "" if step.get("seconds") is None else f"{step['seconds']:.1f}"
            table.add_row(
                name,
                step["state"],
                str(step["attempts"]),
                seconds,
                {True: "yes", False: "no"}.get(facts.get("memoized"), ""),
                str(detail),
            )
        console.print(table)
    releases = store.releases(slug)
    production = store.production_release(slug)
    shown = ", ".join(f"[bold]{n}*[/]" if n == production else str(n) for n in releases)
    console.print(f"releases: {shown or 'none'} (* = production)")


@app.command()
def run(
    source: Annotated[
        str | None, typer.Argument(help="Model source (overrides the config's `source`).")
    ] = None,
    config_path: ConfigOption = None,
    serve_after: Annotated[
        bool,
        typer.Option("--serve/--no-serve", help="Then `modelship up`: gateway + replicas."),
    ] = True,
    storage: Annotated[
        Path | None,
        typer.Option("--storage", envvar=STORAGE_ENV, help="Storage root (overrides config)."),
    ] = None,
) -> None:
    """acquire -> optimize -> select -> serve (`modelship up`), memoized and resumable."""
    from modelship.pipeline.run import run_pipeline

    config = load_config(config_path, source=source, storage=storage)
    store = Storage(config.storage)
    with make_progress(err_console) as progress:
        tasks: dict[str, int] = {}

        def on_change(name: str, record) -> None:
            if name not in tasks:
                tasks[name] = progress.add_task(name, total=1)
            detail = record.state + (f" ({record.error})" if record.error else "")
            if record.state == "done" and record.facts.get("memoized"):
                detail = "done (memoized)"
            progress.update(
                tasks[name],
                description=f"{name}: {detail}",
                completed=1 if record.state in ("done", "failed", "blocked") else 0,
            )

        try:
            slug, _ = run_pipeline(config, store, on_change=on_change)
        except (PipelineError, StorageError) as exc:
            progress.stop()
            fail(f"{exc}\nsee `modelship status` and the step logs", exit_code(exc))
            return
    production = store.production_link(slug)
    console.print(f"[green]production[/]: {production.resolve()}")
    console.print(f"report: {production / 'report.md'}")
    if not serve_after:
        return
    from modelship.cli.common import serve_fleet

    serve_fleet(config, store, slug)
