"""Shared fixtures: tiny random models and the demo model, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelship.storage import Storage

from tiny_models import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="session")
def demo_storage(tmp_path_factory: pytest.TempPathFactory) -> Storage:
    """A storage root holding the acquired demo model (the GGUF conversion runs once)."""
    from modelship.pipeline.acquire import acquire

    storage = Storage(tmp_path_factory.mktemp("demo-storage"))
    acquire("demo", storage)
    return storage


@pytest.fixture(scope="session")
def demo_model_dir(demo_storage: Storage) -> Path:
    from modelship.pipeline.acquire import DEMO_SLUG

    return demo_storage.base_dir(DEMO_SLUG)
