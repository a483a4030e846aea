"""The `modelship` command line: one module per command group, assembled here.

Each group imports only `common` (consoles, options, config, exit codes); this module
puts them in one Typer app.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Annotated

import typer

from modelship.cli import deploy, fleet, models, pipeline, serve

app = typer.Typer(
    help="modelship: from a model name to a fast, OpenAI-compatible production API.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # every command: -h too
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"modelship {version('modelship')}")
        raise typer.Exit()


@app.callback()
def _top(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            metavar="",  # a switch: no value to name
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """modelship: from a model name to a fast, OpenAI-compatible production API."""


for group in (pipeline.app, models.app, serve.app, fleet.app):
    app.registered_commands += group.registered_commands
app.add_typer(fleet.release_app, name="release")
app.add_typer(deploy.deploy_app, name="deploy")


def main() -> None:
    app()
