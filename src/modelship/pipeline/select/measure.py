"""Select's measurements of what has no evaluation yet: quality of each candidate in turn
(teacher-forced against the base model, with the numerics it would be served with), then
serving of all of them together in interleaved rounds (`serving_benchmark`). Each
evaluation goes to `evaluations/<name>.json` when complete; `load_memoized` reads one back
when it was made from the same inputs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from modelship.pipeline.calibration import held_out_texts
from modelship.pipeline.errors import PipelineError
from modelship.pipeline.select import quality as q
from modelship.pipeline.select.candidates import Candidate
from modelship.pipeline.select.serving_benchmark import Workload, measure_serving
from modelship.pipeline.select.tool_use import load_tool_tasks
from modelship.serve_options import ServeOptions
from modelship.storage import Storage, verify_artifact, write_json_atomic

BASE = "base"


def artifact_folder(storage: Storage, slug: str, variant: str) -> Path:
    """The folder a variant name stands for: the base model's, or an optimized variant's."""
    return storage.base_dir(slug) if variant == BASE else storage.variant_dir(slug, variant)


def load_memoized(storage, slug, candidate: Candidate, wanted: str, evaluations, log) -> bool:
    """Whether the candidate's evaluation on storage was made from the same inputs (then
    it joins `evaluations` as it is)."""
    path = storage.evaluations_dir(slug) / f"{candidate.name}.json"
    if not path.is_file():
        return False
    existing = json.loads(path.read_text())
    if existing.get("inputs_hash") != wanted:
        return False
    evaluations[candidate.name] = existing
    log(f"{candidate.name}: evaluation memoized")
    return True


class Measurer:
    """Measures what select has no evaluation of: quality of each candidate in turn
    (deterministic, with the numerics it would be served with), then serving of all of
    them together in interleaved rounds (`serving_benchmark`); each evaluation written to
    `evaluations` (and storage) when complete. The base model's scorer and reference
    distributions are made on first use."""

    def __init__(self, storage, slug, config, evaluations, log, benchmark=None) -> None:
        self.storage, self.slug, self.config = storage, slug, config
        self.evaluations, self.log, self.benchmark = evaluations, log, benchmark
        self.evaluations_dir = storage.evaluations_dir(slug)
        # quality measured, serving not yet: name -> (evaluation, candidate, seconds)
        self.pending: dict[str, tuple[dict[str, Any], Candidate, float]] = {}
        self._base: q.Scorer | None = None  # with `_reference`, made by `_base_scorer`
        self._reference = None
        self._tasks, self._tool_tasks = q.load_tasks(), load_tool_tasks()

    def measured(self) -> dict[str, dict[str, Any]]:
        """Every evaluation so far, those still waiting for serving included."""
        return self.evaluations | {name: e for name, (e, _, _) in self.pending.items()}

    def _base_scorer(self) -> q.Scorer:
        """The base model's scorer, and its distributions on the held-out passages (the
        reference every candidate is compared with), made once."""
        if self._base is None:
            s = self.config.select
            self._base = q.Scorer(self.storage.base_dir(self.slug))
            chunks = q.eval_chunks(
                self._base.tokenizer, held_out_texts(), s.eval_chunks, s.eval_chunk_tokens
            )
            self._reference = q.make_reference(self._base, chunks)
        return self._base

    def measure_quality(self, todo: list[tuple[Candidate, str | None]]) -> None:
        benchmark = self.benchmark
        for candidate, inputs_hash in todo:
            name = candidate.name
            folder = artifact_folder(self.storage, self.slug, candidate.variant)
            evaluation: dict[str, Any] = {"variant": name, "path": str(folder)}
            if candidate.engine:  # a served-numerics candidate (`candidates.py`)
                evaluation |= {"source_variant": candidate.variant, "engine": candidate.engine}
            evaluation["inputs_hash"] = inputs_hash or "unreadable"
            started = time.perf_counter()
            try:
                if inputs_hash is None:
                    raise PipelineError(f"{folder} is missing or has no readable manifest")
                verify_artifact(folder)
                base_scorer = self._base_scorer()
                self.log(f"{name}: measuring quality")
                lm_head = candidate.engine.get("lm_head", self.config.serve.engine.lm_head)
                scorer = base_scorer if name == BASE else q.Scorer(folder, lm_head=lm_head)
                quality = q.measure_quality(
                    scorer,
                    self._reference,
                    self._tasks,
                    self._tool_tasks,
                    benchmark.items if benchmark else None,
                )
                evaluation["quality"] = quality.to_dict()
                if benchmark is not None:
                    evaluation["benchmark"] = benchmark.describe()
                evaluation["weight_bytes"] = scorer.weight_bytes()
                if scorer is not base_scorer:
                    del scorer
            except Exception as exc:  # a variant that cannot be measured is gated, not fatal
                evaluation["load_error"] = _reason(exc)
                self.log(f"{name}: {evaluation['load_error']}")
            seconds = time.perf_counter() - started
            if name == BASE or "load_error" in evaluation:  # the base is the reference only
                _write_evaluation(self.evaluations_dir, evaluation, seconds, self.evaluations)
            else:
                self.pending[name] = (evaluation, candidate, seconds)

    def measure_serving(self) -> None:
        pending, s = self.pending, self.config.select
        if not pending:
            return
        self.log(f"measuring serving of {', '.join(pending)}: interleaved rounds")
        started = time.perf_counter()
        options = ServeOptions(engine=self.config.serve.engine)
        candidates = {name: candidate for name, (_, candidate, _) in pending.items()}
        outcomes = measure_serving(
            {
                name: artifact_folder(self.storage, self.slug, c.variant)
                for name, c in candidates.items()
            },
            self._base_scorer().tokenizer,
            lambda name: (
                candidates[name]
                .serve_options(options.model_copy(update={"variant": name}))
                .replica_args()
            ),
            Workload(
                latency_requests=s.latency_requests,
                concurrency=s.concurrency,
                throughput_requests=s.throughput_requests,
                prompt_tokens=s.prompt_tokens,
                output_tokens=s.output_tokens,
                min_rounds=s.min_rounds,
                max_rounds=s.max_rounds,
                ci_target=s.ci_target,
                budget_s=s.serving_budget_s,
            ),
            log_dir=self.evaluations_dir / "logs",
            log=self.log,
        )
        serving_seconds = (time.perf_counter() - started) / len(pending)  # a fair share each
        for name, (evaluation, _, seconds) in pending.items():
            outcome = outcomes[name]
            if isinstance(outcome, str):
                evaluation["load_error"] = outcome
            else:
                evaluation["serving"] = outcome.to_dict()
            _write_evaluation(
                self.evaluations_dir, evaluation, seconds + serving_seconds, self.evaluations
            )
        pending.clear()
        self._base = self._reference = None  # the base's weights and KV cache, freed


def _write_evaluation(evaluations_dir, evaluation, seconds, evaluations) -> None:
    evaluation["seconds"] = round(seconds, 2)
    write_json_atomic(evaluations_dir / f"{evaluation['variant']}.json", evaluation)
    evaluations[evaluation["variant"]] = evaluation


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
