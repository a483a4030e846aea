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


@app.command()
def serve(
    model_dir: Annotated[Path, typer.Argument(help="An HF model folder (base, variant, release).")],
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name clients use (default: the folder name).")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="MODELSHIP_API_KEY", help="Require this bearer key.")
    ] = None,
    variant: Annotated[str, typer.Option(help="Variant label on metrics.")] = "base",
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    dtype: Annotated[
        str | None, typer.Option(help="float32, bfloat16 or float16 (default: per device).")
    ] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Context length cap.")] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Sequences per step.")] = 64,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Token budget per step.")] = 2048,
    kv_cache_memory_mb: Annotated[int, typer.Option(help="KV cache budget in MiB.")] = 512,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    max_waiting_requests: Annotated[
        int, typer.Option(help="Queue bound before 429 (requests).")
    ] = 1024,
    prefix_caching: Annotated[bool, typer.Option(help="Reuse cached prompt blocks.")] = True,
    grace_period: Annotated[
        float, typer.Option(help="Seconds to finish requests on SIGTERM.")
    ] = 30.0,
) -> None:
    """Serve a model with the OpenAI API (chat, completions, models, metrics)."""
    from modelship.engine import EngineConfig
    from modelship.pipeline.acquire import validate_model_folder
    from modelship.server.launcher import serve as run_server

    try:
        validate_model_folder(model_dir)
        config = EngineConfig(
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory_bytes=kv_cache_memory_mb * 1024**2,
            block_size=block_size,
            max_waiting_requests=max_waiting_requests,
            enable_prefix_caching=prefix_caching,
        )
    except (PipelineError, ValueError) as exc:
        fail(str(exc))
        return
    import logging

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_server(
        model_dir,
        host=host,
        port=port,
        served_model_name=served_model_name,
        api_key=api_key,
        variant=variant,
        grace_period_s=grace_period,
        engine_config=config,
    )


def main() -> None:
    app()
