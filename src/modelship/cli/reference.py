"""docs/cli-reference.md, written from the CLI's own command tree so it cannot drift.

    python -m modelship.cli.reference > docs/cli-reference.md

Every command (groups included, hidden ones left out) gets its help text, its usage line
and a table of its arguments and options, as `modelship COMMAND --help` knows them.
tests/test_cli_reference.py fails when the committed file differs from this output.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import typer

# typer 0.29 carries its own copy of click (`typer._click`), so the objects below are
# told apart by what they have, not by click's classes.
Context = Any
Command = Any
Parameter = Any

HEADER = """# modelship CLI reference

Generated from the command line itself by `python -m modelship.cli.reference >
docs/cli-reference.md`; `tests/test_cli_reference.py` fails when it is out of date. Exit
codes are in the README's [Exit codes](../README.md#exit-codes) section.
"""


def _cell(text: str) -> str:
    """One table cell: a single line, its pipes escaped so the row keeps its columns."""
    return " ".join(text.split()).replace("|", "\\|")


def _is_group(command: Command) -> bool:
    return hasattr(command, "list_commands")


def _subcommands(command: Command, ctx: Context) -> list[tuple[str, Command]]:
    """The visible subcommands of a group, by name."""
    found = [(name, command.get_command(ctx, name)) for name in command.list_commands(ctx)]
    return sorted((name, sub) for name, sub in found if sub is not None and not sub.hidden)


def _summary(command: Command) -> str:
    """The first paragraph of a command's help (click's short help cuts at "e.g.")."""
    return (command.short_help or command.help or "").strip().split("\n\n")[0]


def _commands(command: Command, ctx: Context) -> Iterator[Context]:
    """`ctx` and the context of every visible subcommand below it, depth first, by name."""
    yield ctx
    if _is_group(command):
        for name, sub in _subcommands(command, ctx):
            yield from _commands(sub, type(ctx)(sub, info_name=name, parent=ctx))


def _param_rows(params: list[Parameter], ctx: Context) -> list[str]:
    """A table of parameters as `--help` lists them: name and metavar, then help with its
    default, environment variable and range."""
    rows = ["| argument / option | help |", "| --- | --- |"]
    for param in params:
        record = param.get_help_record(ctx)
        if record is not None:
            rows.append(f"| `{_cell(record[0])}` | {_cell(record[1])} |")
    return rows


def command_section(ctx: Context) -> str:
    """The markdown of one command: heading, help, usage, parameter table."""
    command = ctx.command
    lines = [f"## {ctx.command_path}", ""]
    if command.help:
        lines += [command.help.strip(), ""]
    usage = " ".join(command.collect_usage_pieces(ctx))
    lines += [f"    {ctx.command_path} {usage}", ""]
    params = [p for p in command.get_params(ctx) if not p.hidden and p.name != "help"]
    if _is_group(command):
        rows = [
            f"| `{name}` | {_cell(_summary(sub))} |" for name, sub in _subcommands(command, ctx)
        ]
        lines += ["| command | what it does |", "| --- | --- |", *rows, ""]
    # Options in help panels (`rich_help_panel`) get a table per panel, in first-seen order.
    panels: dict[str | None, list[Parameter]] = {}
    for param in params:
        panels.setdefault(getattr(param, "rich_help_panel", None), []).append(param)
    for panel, members in panels.items():
        if panel is not None:
            lines += [f"{panel}:", ""]
        lines += [*_param_rows(members, ctx), ""]
    return "\n".join(lines)


def cli_reference(app: typer.Typer) -> str:
    """The whole reference for `app`, as committed in docs/cli-reference.md."""
    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="modelship")
    sections = [command_section(sub) for sub in _commands(root, ctx)]
    return HEADER + "\n" + "\n".join(sections).rstrip() + "\n"


def main() -> None:
    from modelship.cli import app

    sys.stdout.write(cli_reference(app))


if __name__ == "__main__":
    main()
