"""The golden answers a release's replicas are probed against (`gateway/drift.py`), read
from the release on storage: its own variant's in `golden.json`, a cheaper tier's from
select's evaluation of it in `production_metrics.json` (select measured every variant the
same way)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from modelship.release import golden
from modelship.storage import Storage, StorageError, read_manifest

logger = logging.getLogger(__name__)


def evaluated_golden(release_dir: Path, variant: str) -> list[golden.GoldenAnswer] | None:
    """`variant`'s golden answers as select's evaluation of it recorded them."""
    path = release_dir / "production_metrics.json"
    try:
        metrics = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    serving = ((metrics.get("evaluations") or {}).get(variant) or {}).get("serving") or {}
    answers = serving.get("golden")
    return [golden.GoldenAnswer(**answer) for answer in answers] if answers else None


class GoldenSource:
    """Each (release, variant)'s golden answers, read once."""

    def __init__(self, storage: Storage, slug: str) -> None:
        self.storage = storage
        self.slug = slug
        self._answers: dict[tuple[int, str], list[golden.GoldenAnswer] | None] = {}

    def reference(self, release: int, variant: str) -> list[golden.GoldenAnswer] | None:
        """None: none recorded, or unreadable (logged once; that replica is not probed)."""
        key = (release, variant)
        if key not in self._answers:
            folder = self.storage.release_dir(self.slug, release)
            try:
                if variant == read_manifest(folder).extra.get("variant"):
                    answers = golden.read_reference(folder / golden.GOLDEN_FILE)
                else:
                    answers = evaluated_golden(folder, variant)
            except (OSError, ValueError, KeyError, TypeError, StorageError) as exc:
                logger.warning("release %s, variant %s: golden answers unreadable (%s); not "
                               "probed", release, variant, exc)  # fmt: skip
                answers = None
            self._answers[key] = answers
        return self._answers[key]
