"""The README keeps the order a newcomer needs it in, `make run` / `make test` first (a
project rule), and an exit-code table that covers every code the CLI uses."""

from __future__ import annotations

import re
from pathlib import Path

from modelship.cli.exit_codes import ExitCode

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
ORDER = [
    "What modelship is",
    "Quick start",
    "Using the API",
    "Configuration",
    "The fleet",
    "Kubernetes",
    "Reference",
    "Exit codes",
]


def test_make_run_and_make_test_come_first() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first_block and README.index(first_block.group(0)) < README.index("\n## ")
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make run", "make test"]


def test_sections_come_in_the_newcomers_order() -> None:
    headings = re.findall(r"^## (.+)$", README, re.M)
    found = [next(h for h in headings if h.startswith(name)) for name in ORDER]
    assert [headings.index(h) for h in found] == sorted(headings.index(h) for h in found)


def test_the_exit_code_table_lists_every_code_the_cli_uses() -> None:
    section = README[README.index("## Exit codes") :]
    codes = {int(code) for code in re.findall(r"^\| (\d+) \|", section, re.M)}
    assert {int(code) for code in ExitCode} <= codes
