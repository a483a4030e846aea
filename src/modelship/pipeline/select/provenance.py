"""The fixed part of a release's provenance, as `select` publishes it: the source, each
variant's identity, the measurements with their intervals, every gate result and score,
and why the winner won (the record itself: `release/provenance.py`).
"""

from __future__ import annotations

from typing import Any

from modelship.pipeline.select.candidates import Candidate
from modelship.pipeline.select.report import explain
from modelship.pipeline.select.scoring import Ranking
from modelship.release.provenance import actor, artifact_identity
from modelship.storage import Storage
from modelship.storage.manifest import now_iso


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
            s.variant: artifact_identity(storage.variant_dir(slug, _source(ranking, s.variant)))
            for s in scores
        },
        "selection": {
            "weights": weights,
            "gates": ranking.gates.__dict__,
            "min_effect": ranking.min_effect,
            "bootstrap": ranking.bootstrap,
            "why": explain(scores, weights),
            "ranking": [
                {
                    "variant": s.variant,
                    "passed": s.passed,
                    "gate_failures": s.reasons,
                    "gate_warnings": s.warnings,
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


def _source(ranking: Ranking, name: str) -> str:
    """The variant whose folder a candidate loads (itself, but for served-numerics ones)."""
    return Candidate.of(ranking.evaluations[name]).variant


def _measurement(evaluation: dict[str, Any]) -> dict[str, Any]:
    serving = evaluation.get("serving") or {}
    record: dict[str, Any] = {
        "quality": evaluation.get("quality"),
        "quality_share": evaluation.get("quality_share"),
        "quality_share_ci95": evaluation.get("quality_share_ci95"),
        "quality_share_differences": evaluation.get("quality_share_differences"),
        "quality_ci95": evaluation.get("quality_ci95"),
        "benchmark": evaluation.get("benchmark"),  # dataset, version, checksums, items
        "degeneration": evaluation.get("degeneration"),
        "weight_bytes": evaluation.get("weight_bytes"),
        # served-numerics candidates: whose folder, with which engine options on top
        "source_variant": evaluation.get("source_variant"),
        "engine": evaluation.get("engine"),
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
