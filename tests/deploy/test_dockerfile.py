"""The image recipe agrees with the manifests (non-root uid, constraints, what it copies),
and ships CPU kernels its runtime stage loads without a compiler."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from k8s_tools import REPO_ROOT
from torch.utils import cpp_extension

from modelship.deploy.pod import RUN_AS_USER
from modelship.model import cpu_kernels

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


def stages() -> dict[str, list[str]]:
    """Each stage's instructions, by the name after `AS`."""
    found: dict[str, list[str]] = {}
    current: list[str] = []
    for line in INSTRUCTIONS:
        if line.split()[0].upper() == "FROM":
            current = found.setdefault(line.split()[-1], [])
        else:
            current.append(line)
    return found


def stage_env(stage: list[str]) -> dict[str, str]:
    env = {}
    for line in stage:
        if line.split()[0].upper() == "ENV":
            env.update(item.split("=", 1) for item in line.split()[1:])
    return env


def kernel_build_commands() -> list[str]:
    return [
        line[4:] for line in stages()["build"] if line.startswith("RUN ") and "cpu_kernels" in line
    ]


def test_the_image_builds_the_cpu_kernels_where_its_runtime_loads_them() -> None:
    build, runtime = stages()["build"], stages()["runtime"]
    assert kernel_build_commands(), "no RUN of the build stage builds the CPU kernels"
    where = stage_env(build)["TORCH_EXTENSIONS_DIR"]
    assert stage_env(runtime)["TORCH_EXTENSIONS_DIR"] == where
    copied = [line.split()[-1] for line in runtime if line.startswith("COPY --from=build")]
    assert any(where.startswith(f"{folder.rstrip('/')}/") for folder in copied), copied
    assert not any("g++" in line or "build-essential" in line for line in runtime)


def shell_env(path: Path | str, extensions: Path) -> dict[str, str]:
    """An environment like the image's: this checkout's sources, `path` as PATH."""
    return {"PATH": str(path), "TORCH_EXTENSIONS_DIR": str(extensions), "HOME": os.environ["HOME"],
            "PYTHONPATH": str(REPO_ROOT / "src")}  # fmt: skip


@pytest.mark.skipif(not cpu_kernels.cpu_has_avx2(), reason="the kernels need AVX2")
@pytest.mark.timeout(1200)  # a build from scratch on a loaded 2-core machine
def test_the_build_stage_commands_build_kernels_a_compilerless_runtime_loads(
    tmp_path: Path,
) -> None:
    """The build stage's kernel command, run here as `RUN` runs it (`/bin/sh -c`, no docker; with
    this environment's python), leaves a library that a process with no compiler and no
    ninja on its PATH loads; with no compiler the same command fails, as the image build
    must. A library this machine already built under the same name seeds the folder (the
    name's digest covers sources, flags and torch), so the test need not compile again."""
    extensions = tmp_path / "torch-extensions"
    name = cpu_kernels._build_name()
    cached = Path(cpp_extension._get_build_directory(name, False))  # this machine's cache
    if (cached / f"{name}.so").is_file():
        shutil.copytree(cached, extensions / name, ignore=shutil.ignore_patterns("*lock"))
    tools = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    for command in kernel_build_commands():
        done = subprocess.run(["/bin/sh", "-c", command], env=shell_env(tools, extensions),
                              capture_output=True, text=True, timeout=1100)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    library = extensions / name / f"{name}.so"
    built_at = library.stat().st_mtime_ns

    bare = tmp_path / "bare-bin"  # python (this environment's), and nothing that compiles
    bare.mkdir()
    (bare / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bare / "python").chmod(0o755)
    load = ("import shutil, sys; from modelship.model import cpu_kernels; "
            "assert not (shutil.which('c++') or shutil.which('g++') or shutil.which('ninja')); "
            "sys.exit(0 if cpu_kernels.load() else 1)")  # fmt: skip
    loaded = subprocess.run(["python", "-c", load], env=shell_env(bare, extensions),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert library.stat().st_mtime_ns == built_at  # loaded, not rebuilt

    empty = tmp_path / "empty-extensions"  # nothing prebuilt, no compiler: the build fails
    for command in kernel_build_commands():
        failed = subprocess.run(["/bin/sh", "-c", command], env=shell_env(bare, empty),
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert failed.returncode != 0
        assert "did not build" in failed.stderr


def test_the_installed_package_carries_every_kernel_source() -> None:
    """`pip install .` (the image's install) copies package data by these globs: a header
    left out failed the installed build's digest of its inputs, and no kernel loaded."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["modelship"]
    package = Path(cpu_kernels.__file__).resolve().parents[1]
    for path in [*cpu_kernels._SOURCES, *cpu_kernels._HEADERS]:
        relative = path.resolve().relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in globs), relative
