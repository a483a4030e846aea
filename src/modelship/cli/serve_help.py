"""How `modelship serve --help` reads: its many flags in panels, every name whole.

Typer's rich table cuts long flag names to fit 80 columns (`--served-model-n…`) once a
command has as many flags as `serve`; click's plain layout never cuts a name (a long one
puts its help on the next line). `PanelledCommand` keeps that layout and groups the flags
by their `rich_help_panel`; `flag_metavar` names a flag's value as a user reads it (`N`,
`float32|bfloat16`), not by its Python type (`<int range>`, `<list[str]>`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from typer.core import TyperCommand

from modelship.flags import FlagSpec, unwrap_optional


class PanelledCommand(TyperCommand):
    """A typer command whose help lists its parameters panel by panel, in click's layout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["rich_markup_mode"] = None  # click's layout: names are never cut
        super().__init__(*args, **kwargs)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                record = (_term(param, ctx), record[1])
                name = getattr(param, "rich_help_panel", None) or "Options"
                panels.setdefault(name, []).append(record)
        for name, records in panels.items():
            with formatter.section(name):
                formatter.write_dl(records)


def _term(param: click.Parameter, ctx: click.Context) -> str:
    """A parameter as its help names it: the short options and the first long spelling of
    each sense (`--prefix-caching / --no-prefix-caching`: the aliases are named in the
    help, a line of every spelling would overflow 80 columns), then its value's metavar."""
    if param.param_type_name == "argument":  # typer writes `MODEL <str>`: the type is noise
        return param.metavar or (param.name or "").upper()

    def spelled(opts: list[str]) -> str:
        short = [opt for opt in opts if not opt.startswith("--")]
        return ", ".join(short + [opt for opt in opts if opt.startswith("--")][:1])

    senses = [spelled(opts) for opts in (param.opts, param.secondary_opts) if opts]
    term = " / ".join(senses)
    if not getattr(param, "is_flag", False) and param.metavar:
        term += f" {param.metavar}"
    return term


def flag_metavar(spec: FlagSpec) -> str | None:
    """What the help shows for a flag's value: its choices, NAME=PATH for a mapping, N for
    an integer, X for a number, PATH, TEXT; None for a bool (a switch takes no value)."""
    if spec.is_mapping:
        return "NAME=PATH"
    if spec.choices is not None:
        return "|".join(spec.choices)
    base = unwrap_optional(spec.annotation)[0]
    return {bool: None, int: "N", float: "X", Path: "PATH"}.get(base, "TEXT")
