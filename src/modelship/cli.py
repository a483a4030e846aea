"""The `modelship` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from modelship.pipeline.errors import PipelineError
from modelship.progress import make_progress
from modelship.storage import STORAGE_ENV, Storage, StorageError

app = typer.Typer(
    help="modelship: from a model name to a fast, OpenAI-compatible production API.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

StorageOption = Annotated[
    Path,
    typer.Option(
        "--storage",
        envvar=STORAGE_ENV,
        help="Storage root shared by all stages.",
        show_default=True,
    ),
]


def fail(message: str, code: int = 1) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


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
        fail(str(exc))
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
) -> None:
    """Check an artifact folder against its manifest."""
    from modelship.storage import verify_artifact

    try:
        manifest = verify_artifact(artifact, full=full)
    except StorageError as exc:
        fail(str(exc))
        return
    mode = "sha256" if full else "sizes"
    console.print(f"[green]ok[/] {artifact}: {len(manifest.files)} files match ({mode})")


def main() -> None:
    app()
