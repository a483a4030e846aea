"""The quick versions of the reliability drills (`benchmarks/drills.py --quick`) on the tiny
model: every pass rule of every drill must hold. Each drill bounds its own time."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from drill.common import DrillContext, run_drill
from drills import NOT_BY_DEFAULT, available_drills

# 7 drills, about 7 minutes in CI: handed to a worker first (tests/conftest.py)
pytestmark = pytest.mark.long

QUICK_DRILLS = [name for name in available_drills() if name not in NOT_BY_DEFAULT]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", QUICK_DRILLS)
def test_quick_drill_passes(name: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    module = importlib.import_module(available_drills()[name])
    result = run_drill(name, module.run, DrillContext(tiny_llama_dir, tmp_path, quick=True))
    assert result.passed, "\n".join(result.failures())
