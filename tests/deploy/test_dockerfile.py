"""The image recipe agrees with the manifests: non-root uid, constraints, what it copies."""

from __future__ import annotations

import fnmatch
import re

from k8s_tools import REPO_ROOT

from modelship.deploy.pod import RUN_AS_USER

DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()
# Backslash continuations joined: one logical instruction per line.
INSTRUCTIONS = [
    line.strip()
    for line in re.sub(r"\\\n", " ", DOCKERFILE).splitlines()
    if line.strip() and not line.lstrip().startswith("#")
]


def instructions(keyword: str) -> list[str]:
    return [line for line in INSTRUCTIONS if line.split()[0].upper() == keyword]


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    excluded = False
    for raw in (REPO_ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/").removeprefix("**/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path.split("/")[-1], pattern):
            excluded = not negate
    return excluded


def test_multi_stage_with_a_runtime_stage() -> None:
    stages = instructions("FROM")
    assert len(stages) >= 2
    assert stages[-1].endswith("AS runtime")
    assert any("--from=build" in line for line in instructions("COPY"))


def test_runs_as_the_uid_the_manifests_expect() -> None:
    user = instructions("USER")[-1].split()[1]
    assert user == f"{RUN_AS_USER}:{RUN_AS_USER}"
    assert f"--uid {RUN_AS_USER}" in DOCKERFILE


def test_installs_with_the_constraints() -> None:
    installs = [line for line in instructions("RUN") if "pip install" in line]
    project = [
        line for line in installs if re.search(r"pip install [^&]*-c constraints.txt \.", line)
    ]
    assert project, installs
    for line in installs:
        for command in line.split("&&"):
            if "pip install" in command and "--no-deps" not in command:
                assert "-c constraints.txt" in command, command


def test_entrypoint_is_the_cli() -> None:
    assert instructions("ENTRYPOINT") == ['ENTRYPOINT ["modelship"]']


def test_every_copied_path_exists_and_is_not_ignored() -> None:
    for line in instructions("COPY"):
        if "--from=" in line:
            continue
        sources = line.split()[1:-1]
        for source in sources:
            assert (REPO_ROOT / source).exists(), source
            assert not dockerignore_excludes(source), source


def test_dockerignore_keeps_local_state_out() -> None:
    for path in (".venv", ".git", "modelship-data", "tests", "src/modelship/__pycache__"):
        assert dockerignore_excludes(path), path
