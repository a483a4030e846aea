"""Storage with releases of tiny models, as `select` would leave it, for fleet tests."""

from __future__ import annotations

from pathlib import Path

from modelship.storage import Storage
from modelship.storage.store import link_tree


def _publish(
    storage: Storage, artifact: Path, kind: str, model_dir: Path, variant: str, **extra
) -> None:
    with (
        storage.lock(artifact),
        storage.publish(
            artifact,
            kind=kind,
            source=str(model_dir),
            revision=None,
            inputs_hash=f"test-{artifact.name}",
            extra={"variant": variant, **extra},
        ) as staging,
    ):
        link_tree(model_dir, staging)


def publish_release(
    storage: Storage, slug: str, model_dir: Path, variant: str, engine: dict | None = None
) -> int:
    """Publish `model_dir` as the next release of `slug` (not made production); `engine`:
    the served numerics select records for a release measured with them."""
    number = max(storage.releases(slug), default=0) + 1
    extra = {"engine": engine} if engine else {}
    _publish(storage, storage.release_dir(slug, number), "release", model_dir, variant, **extra)
    return number


def publish_variant(storage: Storage, slug: str, model_dir: Path, variant: str) -> Path:
    """Publish `model_dir` as the optimized variant `variant` of `slug`, as optimize would."""
    artifact = storage.variant_dir(slug, variant)
    _publish(storage, artifact, "optimized", model_dir, variant)
    return artifact


def placeholder_releases(root: Path, slug: str) -> Storage:
    """Storage under `root` with release 1 (fp16, production) and release 2 (gptq) of
    placeholder weights (a config.json only): for tests of the release plan, where no
    replica loads them."""
    storage = Storage(root / "storage")
    weights = root / "weights"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    publish_release(storage, slug, weights, "fp16")
    publish_release(storage, slug, weights, "gptq")
    storage.set_production(slug, 1)
    return storage
