"""Storage with releases of tiny models, as `select` would leave it, for fleet tests."""

from __future__ import annotations

from pathlib import Path

from modelship.storage import Storage
from modelship.storage.store import link_tree


def publish_release(storage: Storage, slug: str, model_dir: Path, variant: str) -> int:
    """Publish `model_dir` as the next release of `slug` (not made production)."""
    number = max(storage.releases(slug), default=0) + 1
    artifact = storage.release_dir(slug, number)
    with (
        storage.lock(artifact),
        storage.publish(
            artifact,
            kind="release",
            source=str(model_dir),
            revision=None,
            inputs_hash=f"test-{number}",
            extra={"variant": variant},
        ) as staging,
    ):
        link_tree(model_dir, staging)
    return number


def publish_variant(storage: Storage, slug: str, model_dir: Path, variant: str) -> Path:
    """Publish `model_dir` as the optimized variant `variant` of `slug`, as optimize would."""
    artifact = storage.variant_dir(slug, variant)
    with (
        storage.lock(artifact),
        storage.publish(
            artifact,
            kind="optimized",
            source=str(model_dir),
            revision=None,
            inputs_hash=f"test-{variant}",
            extra={"variant": variant},
        ) as staging,
    ):
        link_tree(model_dir, staging)
    return artifact
