"""One provenance record per release: where it came from, how it was chosen, what happened
to it since.

`select` writes the fixed part into the release as `provenance.json` when it publishes it
(covered by the release's manifest like every other file): the source and its resolved
revision with checksums, each variant's recipe, tool versions and checksums, the
measurements with their 95% intervals, every gate result and score, why the winner won,
and who published it when (`pipeline/select/provenance.py`). What happens later (canary
weights, judge decisions, rollbacks, promotions) is appended to `traffic.json` by the
release commands and the canary judge; `release.traffic.release_record` joins both, so
`modelship release show N` is one place.
"""

from __future__ import annotations

import getpass
import socket
from pathlib import Path
from typing import Any

from modelship.storage import ArtifactNotFoundError, StorageError, read_manifest

PROVENANCE_FILE = "provenance.json"


def actor() -> str:
    """Who is acting: user@host (the storage may be shared by several machines)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (containers)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def artifact_identity(folder: Path) -> dict[str, Any]:
    """An artifact's identity: manifest fields that say what it is and how it was made."""
    try:
        manifest = read_manifest(folder)
    except (ArtifactNotFoundError, StorageError) as exc:
        return {"path": str(folder), "error": str(exc)}
    return {
        "path": str(folder),
        "kind": manifest.kind,
        "source": manifest.source,
        "revision": manifest.revision,
        "inputs_hash": manifest.inputs_hash,
        "created_at": manifest.created_at,
        "tool_versions": manifest.tool_versions,
        "recipe": manifest.extra.get("recipe"),
        "files": {entry.path: entry.sha256 for entry in manifest.files},
        "total_bytes": manifest.total_bytes,
    }
