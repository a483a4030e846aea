"""Stage 3, select: measure every variant the same way, gate, score, publish the winner.

Quality is measured in this process with our engine's model (teacher-forced, against
the base model's distributions); serving behaviour through a real replica per variant
(`measure.py`). Besides the variants, a served-numerics candidate (a variant's folder
served with engine options on top: the 4-bit output head, `candidates.py`) is measured
and scored like one, and a release of it records the options it was measured with.
Each candidate's numbers go to `evaluations/<name>.json`, memoized on the variant's
inputs, the numerics and the measurement settings, so a rerun measures nothing again. The winner is
published as `releases/<n>/` (its files hard-linked, plus `production_metrics.json` and
the report) and `production` is switched to it atomically; a rerun that would choose the
same thing from the same evaluations publishes nothing.

Quality share of the base (what the quality gate and score read) is the mean of the
task-accuracy, cross-entropy and tool-call retentions (`intervals.py`), each quality number
with a 95% interval from a bootstrap over the items it was measured on, paired between the
variants (the same resamples for all, seeded: the same evaluations give the same
intervals). Top-1 agreement and KL divergence against the base are reported next to it as
fidelity diagnostics.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from modelship.config import ModelshipConfig
from modelship.pipeline.calibration import corpus_hash
from modelship.pipeline.errors import PipelineError
from modelship.pipeline.select import intervals
from modelship.pipeline.select import quality as q
from modelship.pipeline.select.benchmark_data import (
    BenchmarkDataError,
    BenchmarkSet,
    load_benchmark,
)
from modelship.pipeline.select.bootstrap import Resampler
from modelship.pipeline.select.candidates import Candidate, int4_head_candidate
from modelship.pipeline.select.measure import BASE, Measurer, artifact_folder, load_memoized
from modelship.pipeline.select.provenance import provenance_record
from modelship.pipeline.select.report import write_report
from modelship.pipeline.select.scoring import (
    Gates,
    Ranking,
    VariantMeasurement,
    VariantScore,
    score_variants,
    weights_for,
)
from modelship.release import golden
from modelship.release.provenance import PROVENANCE_FILE
from modelship.serve_options import ServeOptions
from modelship.storage import (
    MANIFEST_NAME,
    ArtifactNotFoundError,
    Storage,
    StorageError,
    hash_inputs,
    link_tree,
    read_manifest,
)

# Bumped when what select measures changes, so memoized evaluations are redone.
# 2: interleaved rounds with confidence intervals; 3: tool-call success in the quality share;
# 4: per-item quality records and per-prompt golden checks, for bootstrap intervals;
# 5: quality with the served head (`serve.engine.lm_head`), served-numerics candidates
SELECT_CODE_VERSION = 5

Log = Callable[[str], None]


@dataclass
class SelectionResult:
    winner: str
    release: int
    new_release: bool
    scores: list[VariantScore]
    evaluations: dict[str, dict[str, Any]]
    seconds: float


def measurement_settings(
    config: ModelshipConfig, benchmark: BenchmarkSet | None = None
) -> dict[str, Any]:
    s = config.select
    extra = {"benchmark": benchmark.describe()} if benchmark is not None else {}
    return extra | {
        "code": SELECT_CODE_VERSION,
        "corpus": corpus_hash(),
        "tasks": hash_inputs({"tasks": q.TASKS_PATH.read_text()}),
        "eval": [s.eval_chunks, s.eval_chunk_tokens],
        "workload": [s.latency_requests, s.concurrency, s.throughput_requests,
                     s.prompt_tokens, s.output_tokens],
        "rounds": [s.min_rounds, s.max_rounds, s.ci_target, s.serving_budget_s],
        "engine": config.serve.engine.model_dump(),
    }  # fmt: skip


def evaluation_hash(
    storage: Storage, slug: str, candidate: Candidate, settings: dict
) -> str | None:
    """What a candidate's evaluation depends on; None if its folder is unreadable."""
    try:
        manifest = read_manifest(artifact_folder(storage, slug, candidate.variant))
    except (ArtifactNotFoundError, StorageError):
        return None
    numerics = {"numerics": candidate.engine} if candidate.engine else {}
    inputs = {"variant": candidate.name, "artifact": manifest.inputs_hash, **numerics}
    return hash_inputs(inputs | settings)


def select(
    storage: Storage,
    slug: str,
    config: ModelshipConfig,
    variants: list[str] | None = None,
    log: Log = print,
) -> SelectionResult:
    started = time.perf_counter()
    variants = list(variants or config.optimize.variants)
    optimized = storage.model_dir(slug) / "optimized"
    if not any((optimized / v / MANIFEST_NAME).is_file() for v in variants):
        raise PipelineError(
            f"nothing to select from: no variant of {slug} is optimized yet "
            f"({', '.join(variants)} missing under {optimized}); run `modelship optimize` first"
        )
    benchmark = _load_benchmark(storage, config)
    settings = measurement_settings(config, benchmark)
    evaluations: dict[str, dict[str, Any]] = {}
    measurer = Measurer(storage, slug, config, evaluations, log, benchmark)
    todo = [
        (c, wanted)
        for c in [Candidate(BASE, BASE), *(Candidate(v, v) for v in variants)]
        if (wanted := evaluation_hash(storage, slug, c, settings)) is None
        or not load_memoized(storage, slug, c, wanted, evaluations, log)
    ]
    measurer.measure_quality(todo)
    # served numerics: measured for the int4 variant whose quality came closest to the base
    # (`candidates.py`), once every variant's quality is known
    head = int4_head_candidate(
        storage, slug, measurer.measured(), variants, ServeOptions(engine=config.serve.engine)
    )
    if head is not None:
        wanted = evaluation_hash(storage, slug, head, settings)
        if wanted is None or not load_memoized(storage, slug, head, wanted, evaluations, log):
            measurer.measure_quality([(head, wanted)])
        variants.append(head.name)
    measurer.measure_serving()

    base_eval = evaluations[BASE]
    if base_eval.get("load_error"):
        raise PipelineError(f"the base model could not be measured: {base_eval['load_error']}")
    resampler = Resampler()
    try:
        estimates = intervals.estimate(
            {v: evaluations[v] for v in [BASE, *variants]}, BASE, resampler
        )
    except ValueError as exc:
        raise PipelineError(f"quality intervals: {exc}") from exc
    measurements = [_measurement(evaluations[v], estimates.get(v)) for v in variants]
    weights = weights_for(config.select.preset, dict(config.select.weights))
    gates = Gates(**config.select.gates.model_dump())
    scores = score_variants(measurements, weights, gates, config.select.min_effect)
    _annotate(evaluations, estimates, [BASE, *variants])
    for score in scores:
        for warning in score.warnings:
            log(f"{score.variant}: passed with a warning: {warning}")
    winner = scores[0]
    if not winner.passed:
        reasons = "; ".join(f"{s.variant}: {', '.join(s.reasons)}" for s in scores)
        raise PipelineError(f"no variant passed the gates ({reasons})")

    selection = {
        "evaluations": {v: evaluations[v]["inputs_hash"] for v in [BASE, *variants]},
        "weights": weights,
        "gates": gates.__dict__,
        "min_effect": config.select.min_effect,
        "bootstrap": bootstrap_settings(resampler),
    }
    ranking = Ranking(
        scores, evaluations, weights, gates, config.select.min_effect, selection["bootstrap"]
    )
    release, new = _publish_release(storage, slug, ranking, hash_inputs(selection), log)
    return SelectionResult(
        winner.variant, release, new, scores, evaluations, time.perf_counter() - started
    )


def _load_benchmark(storage: Storage, config: ModelshipConfig) -> BenchmarkSet | None:
    """The configured standard multiple-choice set, read from the cache (never fetched
    here: `make data` does); None when none is configured."""
    s = config.select
    if not s.benchmark_tasks:
        return None
    try:
        return load_benchmark(storage.cache_dir("eval"), s.benchmark_tasks, s.benchmark_items)
    except BenchmarkDataError as exc:
        raise PipelineError(str(exc)) from exc


def bootstrap_settings(resampler: Resampler) -> dict[str, Any]:
    return {
        "resamples": resampler.num_resamples,
        "seed": resampler.seed,
        "level": 0.95,
        "pools": "held-out passages, task items, tool requests, golden prompts",
    }


def _measurement(
    evaluation: dict, estimate: intervals.VariantIntervals | None
) -> VariantMeasurement:
    m = VariantMeasurement(evaluation["variant"])
    if evaluation.get("load_error"):
        m.load_error = evaluation["load_error"]
        return m
    if estimate is None or estimate.share is None:
        m.load_error = "no quality measurement"
        return m
    serving = evaluation["serving"]
    m.noise = dict(serving.get("ci") or {})
    m.metrics = {
        "quality": estimate.share.value,
        "ttft_s": serving["ttft_s"],
        "tpot_s": serving["tpot_s"],
        "throughput_tok_s": serving["throughput_tok_s"],
        "weight_bytes": float(evaluation["weight_bytes"]),
    }
    if serving.get("peak_rss_bytes"):
        m.metrics["peak_rss_bytes"] = float(serving["peak_rss_bytes"])
    m.quality_interval = estimate.share.interval
    m.quality_replicates = estimate.share_replicates
    for name in ("repetition", "printable"):
        measured = getattr(estimate, name)
        if measured is not None:
            setattr(m, name, measured.value)
            setattr(m, f"{name}_interval", measured.interval)
    return m


def _annotate(
    evaluations: dict[str, dict[str, Any]],
    estimates: dict[str, intervals.VariantIntervals],
    names: list[str],
) -> None:
    """Write the selection-time numbers into the evaluations the report and the release's
    JSON show: every quality metric's interval, the quality share with its interval and its
    paired difference from every other variant, and the pooled degeneration shares."""
    for name in names:
        estimate = estimates.get(name)
        if estimate is None:
            continue
        evaluation = evaluations[name]
        evaluation["quality_ci95"] = {
            metric: measured.interval.to_list() for metric, measured in estimate.quality.items()
        }
        if estimate.share is not None:
            evaluation["quality_share"] = estimate.share.value
            evaluation["quality_share_ci95"] = estimate.share.interval.to_list()
            evaluation["quality_share_differences"] = {
                other: estimate.difference(estimates[other]).to_dict()
                for other in names
                if other != name and other in estimates and estimates[other].share is not None
            }
        degeneration = {
            field: getattr(estimate, field).to_dict()
            for field in ("repetition", "printable")
            if getattr(estimate, field) is not None
        }
        if degeneration:
            evaluation["degeneration"] = degeneration


def _publish_release(storage, slug, ranking: Ranking, selection_hash, log) -> tuple[int, bool]:
    winner, scores, evaluations = ranking.winner, ranking.scores, ranking.evaluations
    current = storage.production_release(slug)
    if current is not None:
        try:
            manifest = read_manifest(storage.release_dir(slug, current))
        except (ArtifactNotFoundError, StorageError):
            manifest = None
        if manifest is not None and manifest.inputs_hash == selection_hash:
            log(f"release {current} already holds this selection ({winner.variant})")
            return current, False
    releases_dir = storage.model_dir(slug) / "releases"
    with storage.lock(releases_dir):
        number = max(storage.releases(slug), default=0) + 1
        target = storage.release_dir(slug, number)
        chosen = Candidate.of(evaluations[winner.variant])
        source = storage.variant_dir(slug, chosen.variant)
        # the numerics it was measured with, which `modelship serve` of the release serves
        numerics = {"engine": chosen.engine} if chosen.engine else {}
        metrics = {
            "release": number,
            "variant": winner.variant,
            "score": winner.score,
            "weights": ranking.weights,
            "gates": ranking.gates.__dict__,
            "bootstrap": ranking.bootstrap,
            "ranking": [_score_dict(s) for s in scores],
            "evaluations": evaluations,
            "previous_release": current,
        }
        with storage.publish(
            target,
            kind="release",
            source=str(source),
            revision=read_manifest(source).revision,
            inputs_hash=selection_hash,
            extra={"variant": winner.variant, "score": winner.score, **numerics},
        ) as staging:
            link_tree(source, staging)
            (staging / "production_metrics.json").write_text(json.dumps(metrics, indent=2))
            provenance = provenance_record(storage, slug, number, ranking)
            (staging / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
            answers = (evaluations[winner.variant].get("serving") or {}).get("golden")
            if answers:  # what the drift probe compares every replica of this release with
                golden.write_reference(
                    staging / golden.GOLDEN_FILE, [golden.GoldenAnswer(**a) for a in answers]
                )
            write_report(staging, slug, number, ranking)
    storage.set_production(slug, number)
    log(f"release {number}: {winner.variant} (score {winner.score:.3f}); production -> {number}")
    return number, True


def _score_dict(score: VariantScore) -> dict[str, Any]:
    return {
        "variant": score.variant,
        "passed": score.passed,
        "reasons": score.reasons,
        "warnings": score.warnings,
        "score": score.score,
        "group_scores": score.group_scores,
        "normalized": score.normalized,
    }
