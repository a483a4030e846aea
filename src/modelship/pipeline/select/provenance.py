"""One provenance record per release: where it came from, how it was chosen, what happened
to it since.

`select` writes the fixed part into the release as `provenance.json` when it publishes it
(covered by the release's manifest like every other file): the source and its resolved
revision with checksums, each variant's recipe, tool versions and checksums, the
measurements with their 95% intervals, every gate result and score, why the winner won,
and who published it when. What happens later (canary weights, judge decisions,
rollbacks, promotions) is appended to `traffic.json` by the release commands and the
canary judge; `fleet.releases.release_record` joins both, so `modelship release show N`
is one place.
"""

from __future__ import annotations

import getpass
import socket
from pathlib import Path
from typing import Any

from modelship.pipeline.select.report import explain
from modelship.pipeline.select.scoring import Ranking
from modelship.storage import ArtifactNotFoundError, Storage, StorageError, read_manifest
from modelship.storage.manifest import now_iso

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


def provenance_record(
    storage: Storage, slug: str, release: int, ranking: Ranking
) -> dict[str, Any]:
    """The fixed part of release `release`'s provenance, as `select` publishes it."""
    scores, weights = ranking.scores, ranking.weights
    winner = ranking.winner
    return {
        "release": release,
        "model": slug,
        "variant": winner.variant,
        "published_at": now_iso(),
        "published_by": actor(),
        "source": artifact_identity(storage.base_dir(slug)),
        "variants": {
            s.variant: artifact_identity(storage.variant_dir(slug, s.variant)) for s in scores
        },
        "selection": {
            "weights": weights,
            "gates": ranking.gates.__dict__,
            "min_effect": ranking.min_effect,
            "why": explain(scores, weights),
            "ranking": [
                {
                    "variant": s.variant,
                    "passed": s.passed,
                    "gate_failures": s.reasons,
                    "score": s.score,
                    "group_scores": s.group_scores,
                }
                for s in scores
            ],
        },
        "measurements": {
            name: _measurement(evaluation)
            for name, evaluation in sorted(ranking.evaluations.items())
        },
    }


def _measurement(evaluation: dict[str, Any]) -> dict[str, Any]:
    serving = evaluation.get("serving") or {}
    record: dict[str, Any] = {
        "quality": evaluation.get("quality"),
        "quality_share": evaluation.get("quality_share"),
        "weight_bytes": evaluation.get("weight_bytes"),
        "load_error": evaluation.get("load_error"),
    }
    if serving:
        ci = serving.get("ci") or {}
        record["serving"] = {
            metric: {"mean": serving[metric], "ci95": ci.get(metric)}
            for metric in ("ttft_s", "tpot_s", "throughput_tok_s")
            if metric in serving
        }
        record["serving"]["rounds"] = serving.get("rounds")
        record["serving"]["peak_rss_bytes"] = serving.get("peak_rss_bytes")
    return {key: value for key, value in record.items() if value is not None}
