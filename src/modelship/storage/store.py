"""The storage root: layout, locks and atomic publishing of artifact folders.

    <root>/models/<slug>/base/                  acquire
    <root>/models/<slug>/optimized/<variant>/   optimize
    <root>/models/<slug>/evaluations/           select
    <root>/models/<slug>/releases/<n>/          select
    <root>/models/<slug>/production -> releases/<n>

A writer builds an artifact in a temporary sibling (`.tmp-<name>-<pid>-<hex>`), fsyncs it
and renames it into place, so a reader sees either nothing or the whole artifact. Replacing
takes two renames (the old artifact to `.old-<name>-<hex>`, then the staging folder to
`<name>`). A lock file beside the artifact serializes writers of the same artifact; the next
writer that holds the lock recovers from one that died: an old artifact whose replacement
never arrived is renamed back, then leftover staging and old folders are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from modelship.storage.manifest import (
    MANIFEST_NAME,
    Manifest,
    StorageError,
    now_iso,
    scan_files,
    tool_versions,
    verify_artifact,
)

DEFAULT_ROOT = "./modelship-data"
STORAGE_ENV = "MODELSHIP_STORAGE"
_SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def default_root() -> Path:
    return Path(os.environ.get(STORAGE_ENV) or DEFAULT_ROOT)


def slugify(name: str) -> str:
    """A folder-safe model name: `HuggingFaceTB/SmolLM2-135M` -> `huggingfacetb--smollm2-135m`."""
    slug = name.strip().lower().replace("/", "--")
    slug = re.sub(r"[^a-z0-9._-]+", "-", slug).strip("-.")
    if not slug:
        raise StorageError(f"cannot make a folder name from {name!r}")
    return slug


class Storage:
    """Paths of the storage contract under one root, and the means to publish into it."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    # Layout -------------------------------------------------------------------------------
    def model_dir(self, slug: str) -> Path:
        if not _SLUG_RE.match(slug):
            raise StorageError(f"invalid model slug {slug!r}")
        return self.root / "models" / slug

    def base_dir(self, slug: str) -> Path:
        return self.model_dir(slug) / "base"

    def variant_dir(self, slug: str, variant: str) -> Path:
        return self.model_dir(slug) / "optimized" / variant

    def evaluations_dir(self, slug: str) -> Path:
        return self.model_dir(slug) / "evaluations"

    def release_dir(self, slug: str, number: int) -> Path:
        return self.model_dir(slug) / "releases" / str(number)

    def production_link(self, slug: str) -> Path:
        return self.model_dir(slug) / "production"

    def cache_dir(self, name: str) -> Path:
        """Caches that are not artifacts (e.g. the Hub download cache), kept under the root."""
        return self.root / "cache" / name

    def models(self) -> list[str]:
        """The slugs of the models under the root, sorted: folders under models/ holding a
        base, a variant or a release (a failed first acquire leaves none of them)."""
        folder = self.root / "models"
        if not folder.is_dir():
            return []
        held = ("base", "optimized", "releases")
        return sorted(
            p.name
            for p in folder.iterdir()
            if _SLUG_RE.match(p.name) and any((p / name).exists() for name in held)
        )

    def releases(self, slug: str) -> list[int]:
        folder = self.model_dir(slug) / "releases"
        if not folder.is_dir():
            return []
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())

    def production_release(self, slug: str) -> int | None:
        link = self.production_link(slug)
        if not link.is_symlink():
            return None
        return int(Path(os.readlink(link)).name)

    def set_production(self, slug: str, number: int) -> None:
        """Point `production` at `releases/<number>` atomically (symlink + rename)."""
        target = self.release_dir(slug, number)
        verify_artifact(target)
        link = self.production_link(slug)
        tmp = link.with_name(f".tmp-production-{uuid.uuid4().hex[:8]}")
        os.symlink(Path("releases") / str(number), tmp)
        os.replace(tmp, link)
        _fsync_dir(link.parent)

    # Writing ------------------------------------------------------------------------------
    @contextmanager
    def lock(self, artifact: Path) -> Iterator[None]:
        """Hold an exclusive lock on `artifact` (blocks until other writers are done).

        A writer that fails before anything was ever published there removes the lock file
        (and the folder made for it, if left empty), so a failed first acquire leaves no
        trace; a waiter that then holds the removed file's lock takes a fresh one instead.
        """
        lock_path = artifact.with_name(f".{artifact.name}.lock")
        handle = _locked(lock_path)
        try:
            _recover_dead_writer(artifact)
            yield
        except BaseException:
            if not artifact.exists():
                lock_path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):  # not empty: other artifacts live there
                    artifact.parent.rmdir()
            raise
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()

    @contextmanager
    def publish(
        self,
        artifact: Path,
        *,
        kind: str,
        source: str,
        revision: str | None,
        inputs_hash: str,
        tools: tuple[str, ...] = (),
        extra: dict[str, Any] | None = None,
    ) -> Iterator[Path]:
        """Yield an empty staging folder; on success write its manifest, rename it to `artifact`.

        The caller must hold `lock(artifact)`. If the body raises, the staging folder is
        removed and `artifact` is left as it was. An existing artifact is replaced.
        """
        staging = artifact.with_name(f".tmp-{artifact.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        staging.mkdir(parents=True)
        try:
            yield staging
            manifest = Manifest(
                kind=kind,
                source=source,
                revision=revision,
                inputs_hash=inputs_hash,
                files=scan_files(staging),
                tool_versions=tool_versions(*tools),
                created_at=now_iso(),
                extra=extra or {},
            )
            (staging / MANIFEST_NAME).write_text(manifest.to_json())
            _fsync_tree(staging)
            _swap_into_place(staging, artifact)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def _locked(lock_path: Path):
    """An open handle holding the exclusive lock of the file now at `lock_path`."""
    while True:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            handle = open(lock_path, "a")  # noqa: SIM115 (held past this function)
        except FileNotFoundError:  # the folder went with a failed writer's lock: again
            continue
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            if os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino:
                return handle
        except FileNotFoundError:  # removed by a failed writer while this one waited
            pass
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _swap_into_place(staging: Path, artifact: Path) -> None:
    old = None
    if artifact.exists():
        old = artifact.with_name(f".old-{artifact.name}-{uuid.uuid4().hex[:8]}")
        os.rename(artifact, old)
        # A crash here leaves no `artifact`, only `old`: the next writer renames it back.
    try:
        os.rename(staging, artifact)
    except BaseException:
        if old is not None:
            os.rename(old, artifact)
        raise
    _fsync_dir(artifact.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _recover_dead_writer(artifact: Path) -> None:
    """Recover from a writer of `artifact` that died. Called with the artifact's lock held,
    so every staging or old folder of this artifact (and only of this one: the patterns
    match its exact name, not a sibling `<name>-x`) belongs to a dead writer."""
    name = re.escape(artifact.name)
    staging_re = re.compile(rf"^\.tmp-{name}-\d+-[0-9a-f]{{8}}$")
    old_re = re.compile(rf"^\.old-{name}-[0-9a-f]{{8}}$")
    siblings = list(artifact.parent.iterdir())
    olds = [p for p in siblings if old_re.match(p.name)]
    if olds and not os.path.lexists(artifact):
        # Died between the two renames: the old artifact is the only complete copy.
        newest = max(olds, key=lambda p: p.lstat().st_ctime_ns)  # a rename sets ctime
        os.rename(newest, artifact)
        _fsync_dir(artifact.parent)
        olds.remove(newest)
    for stale in [*olds, *(p for p in siblings if staging_re.match(p.name))]:
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for path in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        _fsync_dir(path)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_tree(source: Path, destination: Path, copy: bool = False) -> None:
    """Hard-link (or copy, across file systems or with `copy`) an artifact's files into
    `destination`, leaving out its manifest (the new artifact gets its own).

    Links are for artifacts of one storage, which nobody writes after their manifest.
    Files that come from outside (a user's folder, the Hub download cache) are copied: a
    link would share their inode, so damage on either side (a file truncated in place)
    would silently change the other, and remaking the artifact would link the damage back.
    Symlinks (a Hub snapshot's entries point into its blob store) are followed.
    """
    for path in sorted(source.rglob("*")):
        if path.is_dir() or path.name == MANIFEST_NAME:
            continue
        target = destination / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not copy:
            try:
                os.link(path.resolve(), target)
                continue
            except OSError:
                pass
        shutil.copyfile(path, target)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write `path` so that readers see the old file or the whole new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
