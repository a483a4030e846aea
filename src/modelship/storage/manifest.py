"""`manifest.json`: what an artifact folder is, where it came from and what it holds."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1
_CHUNK = 4 * 1024 * 1024


class StorageError(Exception):
    """A storage contract was broken; the message names the path."""


class ArtifactNotFoundError(StorageError):
    """The artifact folder or its manifest does not exist."""


class ChecksumMismatchError(StorageError):
    """A file of an artifact is missing or differs from its manifest."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path


@dataclass(frozen=True)
class FileEntry:
    """One file of an artifact, relative to the artifact folder."""

    path: str
    size: int
    sha256: str


@dataclass
class Manifest:
    """The contract every artifact folder carries (see docs/architecture.md)."""

    kind: str  # "base", "optimized", "release", ...
    source: str
    revision: str | None
    inputs_hash: str
    files: list[FileEntry] = field(default_factory=list)
    tool_versions: dict[str, str] = field(default_factory=dict)
    created_at: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, origin: Path) -> Manifest:
        try:
            raw = json.loads(text)
            files = [FileEntry(**entry) for entry in raw.pop("files")]
            return cls(files=files, **raw)
        except (ValueError, TypeError, KeyError) as exc:
            raise StorageError(f"{origin}: not a valid manifest ({exc})") from exc

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def hash_inputs(inputs: dict[str, Any]) -> str:
    """A stable hash of a step's inputs (canonical JSON), used for memoization."""
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def tool_versions(*packages: str) -> dict[str, str]:
    """Installed versions of modelship and the given packages (missing ones are left out)."""
    versions = {}
    for name in ("modelship", *packages):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def scan_files(folder: Path) -> list[FileEntry]:
    """Every regular file under `folder` (except the manifest) with size and sha256, sorted."""
    entries = []
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MANIFEST_NAME:
            entries.append(
                FileEntry(
                    path=path.relative_to(folder).as_posix(),
                    size=path.stat().st_size,
                    sha256=sha256_file(path),
                )
            )
    return entries


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactNotFoundError(f"{path}: no manifest (not a published artifact)")
    return Manifest.from_json(path.read_text(), path)


def verify_artifact(folder: Path, full: bool = False) -> Manifest:
    """Check an artifact against its manifest and return the manifest.

    The fast mode checks that every file exists with its recorded size; `full` also
    recomputes sha256. Any mismatch raises `ChecksumMismatchError` naming the file.
    """
    manifest = read_manifest(folder)
    for entry in manifest.files:
        path = folder / entry.path
        if not path.is_file():
            raise ChecksumMismatchError(path, "listed in the manifest but missing")
        size = os.stat(path).st_size
        if size != entry.size:
            raise ChecksumMismatchError(path, f"size {size} bytes, manifest says {entry.size}")
        if full and sha256_file(path) != entry.sha256:
            raise ChecksumMismatchError(path, "sha256 differs from the manifest (corrupted)")
    return manifest


def intact_artifact(folder: Path) -> Manifest | None:
    """The manifest of the artifact at `folder` if its files still match it (sizes, as
    `verify_artifact` checks); None if nothing is published there, or if it is damaged (a
    manifest edited or unreadable, a file missing or truncated): then the warning names the
    file, and the caller makes the artifact again instead of memoizing a broken one."""
    try:
        return verify_artifact(folder)
    except ArtifactNotFoundError:
        return None
    except StorageError as exc:
        logger.warning("%s; making it again", exc)
        return None
