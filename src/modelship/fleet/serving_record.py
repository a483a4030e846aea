"""`models/<slug>/fleet/up.json`: which `modelship up` serves a model, for `modelship list`.

`up` writes it (atomically) before it listens and removes it when it stops; a record whose
process is gone (killed without the chance to remove it) or runs on another host reads as
not serving. It is a hint for people, never a lock: nothing refuses to start because of it.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from modelship.liveness import alive_here
from modelship.storage import Storage
from modelship.storage.manifest import now_iso
from modelship.storage.store import write_json_atomic

SERVING_FILE = "up.json"


@dataclass(frozen=True)
class ServingRecord:
    url: str  # the gateway's base URL, http://host:port/v1
    pid: int
    hostname: str
    started_at: str


def serving_path(storage: Storage, slug: str) -> Path:
    return storage.model_dir(slug) / "fleet" / SERVING_FILE


def write_serving(storage: Storage, slug: str, url: str) -> ServingRecord:
    """Record this process as serving `slug` at `url`."""
    record = ServingRecord(url, os.getpid(), socket.gethostname(), now_iso())
    write_json_atomic(serving_path(storage, slug), asdict(record))
    return record


def clear_serving(storage: Storage, slug: str) -> None:
    """Remove this process's record (another process's is left alone)."""
    record = read_serving(storage, slug)
    if record is not None and record.pid == os.getpid():
        serving_path(storage, slug).unlink(missing_ok=True)


def read_serving(storage: Storage, slug: str) -> ServingRecord | None:
    """The record of a live `up` on this host serving `slug`, else None."""
    try:
        data = json.loads(serving_path(storage, slug).read_text())
        record = ServingRecord(**data)
    except (OSError, ValueError, TypeError):  # none, half-written by hand, or another shape
        return None
    if record.hostname != socket.gethostname() or not alive_here(record.hostname, record.pid):
        return None
    return record
