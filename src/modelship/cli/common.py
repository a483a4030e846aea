"""What every command group shares: consoles, failing with an exit code, options, config.

Exit codes are defined once, in `modelship.cli.exit_codes` (the table README cites).
"""

from __future__ import annotations

import logging
from enum import StrEnum
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console

from modelship.cli.exit_codes import ExitCode
from modelship.pipeline.errors import PipelineError
from modelship.storage import STORAGE_ENV, Storage

console = Console()
err_console = Console(stderr=True)

FAILURE_EXIT_CODE = ExitCode.FAILURE
CONFIG_EXIT_CODE = ExitCode.USAGE
TRANSIENT_EXIT_CODE = ExitCode.TRANSIENT


def exit_code(exc: Exception) -> int:
    """75 for an error worth retrying (`TransientError`), else 1."""
    from modelship.pipeline.errors import TransientError

    return TRANSIENT_EXIT_CODE if isinstance(exc, TransientError) else FAILURE_EXIT_CODE


def fail(message: str, code: int = FAILURE_EXIT_CODE) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


class LogFormat(StrEnum):
    text = "text"
    json = "json"


def setup_logging(log_format: str = "text") -> None:
    """Log lines of the long-running commands (serve, up, gateway) on stderr: text, or
    one JSON object per line (`log_format: json`, `modelship.logs.JsonFormatter`)."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if log_format == "json":
        from modelship.logs import JsonFormatter

        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health check otherwise
    # lightkube's client (gateway discovery): a line per EndpointSlice list and watch.
    logging.getLogger("httpx2").setLevel(logging.WARNING)


StorageOption = Annotated[
    Path,
    typer.Option(
        "--storage",
        envvar=STORAGE_ENV,
        help="Storage root shared by all stages.",
        show_default=True,
    ),
]
ConfigStorageOption = Annotated[
    Path | None,
    typer.Option(
        "--storage", envvar=STORAGE_ENV, help="Storage root (default: the config's `storage`)."
    ),
]
ModelOption = Annotated[str | None, typer.Option(help="Model slug under models/.")]
ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="pipeline.yaml (default: built-in defaults, demo model)."),
]


def load_config(path: Path | None, **overrides):
    """pipeline.yaml (or the defaults) with `overrides`; a broken file exits 2."""
    from modelship.config import ConfigError, ModelshipConfig

    try:
        return ModelshipConfig.load(path, **overrides)
    except ConfigError as exc:
        fail(str(exc), CONFIG_EXIT_CODE)


def model_context(config_path: Path | None, storage: Path | None, model: str | None):
    """The config (with a `--storage` override), its storage and the slug of the model the
    command acts on (`model_choice.choose_model`); no model to act on exits 1 or 2."""
    from modelship.cli.model_choice import ModelChoiceError, choose_model

    config = load_config(config_path, storage=storage)
    store = Storage(config.storage)
    try:
        slug = choose_model(config, store, model)
    except ModelChoiceError as exc:
        fail(str(exc), exc.code)
    except PipelineError as exc:  # the config's source cannot be resolved
        fail(f"{exc} (pass --model SLUG to name an acquired model)")
    return config, store, slug


def serve_fleet(
    config, storage: Storage, slug: str, host: str | None = None, port: int | None = None
) -> None:
    """Gateway + supervisor + replicas of the production release, until SIGTERM/SIGINT
    (`modelship up`, and `modelship run` after the pipeline)."""
    from modelship.fleet.local import LocalFleet
    from modelship.gateway.launcher import run_gateway
    from modelship.storage import StorageError

    try:
        fleet = LocalFleet(config, storage, slug)
    except (PipelineError, StorageError) as exc:
        fail(str(exc), exit_code(exc))
    setup_logging(config.log_format)
    host = host or config.gateway.host
    port = port or config.gateway.port
    from modelship.fleet.serving_record import clear_serving, write_serving

    url = f"http://{host}:{port}/v1"
    console.print(
        f"[green]serving[/] {fleet.served_model_name} at {url} (replica logs: {fleet.log_dir})"
    )
    write_serving(storage, slug, url)  # what `modelship list` shows as serving
    try:
        run_gateway(fleet.app(), fleet.service, host, port, config.serve.grace_period_s)
    finally:
        clear_serving(storage, slug)
