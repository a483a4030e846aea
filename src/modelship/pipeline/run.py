"""The whole pipeline as a DAG: acquire -> optimize (one step per variant) -> select.

`modelship run` builds it from the config, runs it with the local executor
(`pipeline.dag`), then serves the production release. Steps call the same stage functions
the single-stage commands call, so `modelship optimize` and a step of `modelship run` do
exactly the same work and share memoization.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modelship.config import ModelshipConfig
from modelship.pipeline.dag import DAG, Step, StepContext, StepRecord
from modelship.storage import Storage


def model_slug(config: ModelshipConfig) -> str:
    """The model's folder name under models/, from the source (no network)."""
    from modelship.pipeline.acquire import resolve_source

    return resolve_source(config.source, config.name).slug


def run_dir(storage: Storage, slug: str) -> Path:
    return storage.model_dir(slug) / "pipeline"


def build_steps(config: ModelshipConfig, storage: Storage, slug: str) -> list[Step]:
    variants = config.optimize.variants
    cores = os.cpu_count() or 1
    parallel = min(config.optimize.max_parallel or cores, len(variants))
    threads = max(1, cores // parallel)

    def acquire_step(ctx: StepContext) -> dict[str, Any]:
        from modelship.pipeline.acquire import acquire

        result = acquire(config.source, storage, revision=config.revision, name=config.name)
        ctx.log.info("base at %s (memoized: %s)", result.path, result.memoized)
        return {"memoized": result.memoized, "path": str(result.path)}

    def optimize_step(variant: str) -> Callable[[StepContext], dict[str, Any]]:
        def run(ctx: StepContext) -> dict[str, Any]:
            from modelship.pipeline.optimize import optimize

            [result] = optimize(
                storage,
                slug,
                [variant],
                max_parallel=1,
                overrides={variant: config.optimize.recipes.get(variant, {})},
                num_threads=threads,
                log_path=ctx.log_path,
            )
            ctx.log.info("%s at %s (memoized: %s)", variant, result.path, result.memoized)
            return {"memoized": result.memoized, "path": str(result.path)}

        return run

    def select_step(ctx: StepContext) -> dict[str, Any]:
        from modelship.pipeline.select.runner import select

        result = select(storage, slug, config, log=ctx.log.info)
        return {
            "winner": result.winner,
            "release": result.release,
            "memoized": not result.new_release,
        }

    optimize_names = tuple(f"optimize:{v}" for v in variants)
    steps = [Step("acquire", acquire_step, retry=config.retries)]
    steps += [
        Step(name, optimize_step(v), after=("acquire",), retry=config.retries)
        for name, v in zip(optimize_names, variants, strict=True)
    ]
    steps.append(Step("select", select_step, after=optimize_names, retry=config.retries))
    return steps


def run_pipeline(
    config: ModelshipConfig,
    storage: Storage,
    on_change: Callable[[str, StepRecord], None] | None = None,
) -> tuple[str, dict[str, StepRecord]]:
    """Run acquire -> optimize -> select; returns the slug and each step's record."""
    slug = model_slug(config)
    steps = build_steps(config, storage, slug)
    cores = os.cpu_count() or 1
    parallel = min(config.optimize.max_parallel or cores, len(config.optimize.variants))
    dag = DAG(steps, run_dir(storage, slug), max_parallel=max(parallel, 1), on_change=on_change)
    return slug, dag.run()
