"""The storage contract: artifact folders with manifests, published atomically."""

from modelship.storage.manifest import (
    MANIFEST_NAME,
    ArtifactNotFoundError,
    ChecksumMismatchError,
    FileEntry,
    Manifest,
    StorageError,
    hash_inputs,
    intact_artifact,
    read_manifest,
    sha256_file,
    verify_artifact,
)
from modelship.storage.store import (
    STORAGE_ENV,
    Storage,
    default_root,
    link_tree,
    slugify,
    write_json_atomic,
)

__all__ = [
    "MANIFEST_NAME",
    "STORAGE_ENV",
    "ArtifactNotFoundError",
    "ChecksumMismatchError",
    "FileEntry",
    "Manifest",
    "Storage",
    "StorageError",
    "default_root",
    "hash_inputs",
    "intact_artifact",
    "link_tree",
    "read_manifest",
    "sha256_file",
    "slugify",
    "verify_artifact",
    "write_json_atomic",
]
