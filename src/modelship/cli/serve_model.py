"""What `modelship serve MODEL` serves: the folder, the name clients use and the variant
label, from what a user types (the way `vllm serve` takes a Hub id or a folder).

MODEL is, first match wins:
- an existing folder: a model folder as it is (a release, `production`, an optimized
  variant, a base, any HF folder); a model's own folder in storage (`models/<slug>`)
  serves its production release, else its base;
- the slug of a model in storage: as its folder above;
- `demo`, a `.gguf` file or a Hub repo id (`owner/name`): acquired into storage through the
  acquire stage (memoized: serving it again downloads and converts nothing), then its base
  is served.
Anything else "does not exist" (the message lists the slugs in storage).

A folder inside storage is named after its model's slug (serving `production/` of
`my-model` serves `my-model`, not the release number `1`); elsewhere after the folder. The
variant label is the one the folder's manifest names (a release's or an optimized
variant's), else `base`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import Progress

from modelship.pipeline.acquire import SourceKind, acquire, resolve_source
from modelship.pipeline.errors import AcquireError
from modelship.pipeline.hub import looks_like_repo_id
from modelship.storage import StorageError, read_manifest
from modelship.storage.store import Storage


class ServeModelError(AcquireError):
    """MODEL names nothing servable; the message says what it should have been."""


@dataclass(frozen=True)
class ServedModel:
    """A resolved MODEL argument."""

    path: Path  # the model folder the engine loads
    slug: str | None  # the model in storage it belongs to; None for a folder outside storage
    variant: str  # the label on metrics and /ready
    # the engine numerics a release was measured with (`manifest_engine`): served where the
    # flags leave them at auto (`EngineOptions.with_measured`)
    measured_engine: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The model name clients use unless --served-model-name says otherwise."""
        return self.slug or self.path.resolve().name


def resolve_served_model(
    model: str,
    storage: Storage,
    revision: str | None = None,
    progress: Progress | None = None,
) -> ServedModel:
    """MODEL as a folder to serve, acquiring it first where it is a Hub id, `demo` or a
    `.gguf` file. Raises `ServeModelError` for a name that is nothing of these, and the
    acquire stage's errors (`TransientError` when the Hub cannot be reached) as they are."""
    path = Path(model).expanduser()
    if path.is_dir():
        return served_folder(path)
    slug_dir = storage.root / "models" / model
    if "/" not in model and slug_dir.is_dir():
        return served_folder(slug_dir)
    if path.is_file() or model == "demo" or _is_hub_id(model):
        if path.is_file() and path.suffix.lower() != ".gguf":
            raise ServeModelError(f"{model}: a file to serve must be a .gguf file")
        if revision is not None and resolve_source(model).kind is not SourceKind.HUB:
            raise ServeModelError(f"--revision applies to Hub repos only, not to {model}")
        result = acquire(model, storage, revision, progress=progress)
        return served_folder(result.path)
    models = storage.root / "models"
    slugs = sorted(p.name for p in models.iterdir() if p.is_dir()) if models.is_dir() else []
    there = f" (there: {', '.join(slugs)})" if slugs else ""
    raise ServeModelError(
        f"{model} does not exist: pass a model folder, a .gguf file, 'demo', a Hub repo id "
        f"(owner/name) or the slug of a model in {models}{there}"
    )


def _is_hub_id(model: str) -> bool:
    """Spelled like a Hub repo id with its owner (a bare name is a slug: a typo of one
    should not go to the Hub), and not a path into an existing folder (`models/typo` is a
    missing folder, not a repo of a user called `models`)."""
    parent = Path(model).parent
    return looks_like_repo_id(model) and parent != Path(".") and not parent.exists()


def served_folder(folder: Path) -> ServedModel:
    """A folder as served: a model's own folder in storage resolves to its production
    release (else its base); any other folder is served as it is."""
    if _is_model_home(folder):
        production = folder / "production"
        target = production if production.exists() else folder / "base"
        if not target.is_dir():
            raise ServeModelError(f"{folder}: the model has no production release and no base")
        folder = target
    return ServedModel(
        folder, storage_slug(folder), manifest_variant(folder), manifest_engine(folder)
    )


def _is_model_home(folder: Path) -> bool:
    """`<root>/models/<slug>`: holds the model's artifacts, is no model folder itself."""
    resolved = folder.resolve()
    has_artifacts = any((resolved / name).exists() for name in ("base", "releases", "production"))
    return resolved.parent.name == "models" and has_artifacts


def storage_slug(folder: Path) -> str | None:
    """The slug of the model a published artifact folder belongs to (`models/<slug>/base`,
    `.../optimized/<variant>`, `.../releases/<n>`, `production` through its link), or None
    for a folder that is no artifact in a storage layout."""
    resolved = folder.resolve()
    if not (resolved / "manifest.json").is_file():
        return None
    parents = resolved.parents
    if resolved.name == "base" and len(parents) > 1 and parents[1].name == "models":
        return parents[0].name
    in_group = parents[0].name in ("optimized", "releases")
    if in_group and len(parents) > 2 and parents[2].name == "models":
        return parents[1].name
    return None


def manifest_variant(model_dir: Path) -> str:
    """The variant a published folder's manifest names: a release (`production` included,
    which Kubernetes pods serve without knowing which variant select published) or an
    optimized variant. A folder that is no published artifact serves `base`."""
    try:
        variant = read_manifest(model_dir).extra.get("variant")
    except StorageError:  # no manifest (a plain HF folder), or one that cannot be read
        return "base"
    return variant if isinstance(variant, str) and variant else "base"


def manifest_engine(model_dir: Path) -> dict[str, Any]:
    """The served numerics (engine options, e.g. {"lm_head": "int4"}) a release's manifest
    says select measured its variant with; {} for any other folder."""
    try:
        engine = read_manifest(model_dir).extra.get("engine")
    except StorageError:
        return {}
    return dict(engine) if isinstance(engine, dict) else {}
