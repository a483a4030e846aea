"""Stage 2, optimize: make each variant in its own process, in parallel, memoized.

Each job publishes `models/<slug>/optimized/<variant>/` through the storage contract
(lock, staging folder, manifest, rename), so a job killed halfway leaves nothing and the
next run redoes only the variants whose folder is missing or whose inputs changed.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from modelship.lifetime import die_with_parent
from modelship.pipeline.calibration import corpus_hash
from modelship.pipeline.errors import PipelineError
from modelship.pipeline.optimize.schemes import Recipe, create_scheme
from modelship.storage import Storage, hash_inputs, intact_artifact, read_manifest
from modelship.storage.manifest import tool_versions, verify_artifact

# Bumped when a scheme's output changes for the same recipe, so memoized variants rebuild.
# 2: GPTQ and AWQ calibrate deterministically (one thread, seeded, unshuffled).
# 3: AWQ smooths OLMoE's and Mixtral's routers with their experts.
OPTIMIZE_CODE_VERSION = 3


@dataclass(frozen=True)
class VariantResult:
    variant: str
    path: Path
    memoized: bool
    seconds: float


def recipe_for(variant: str, overrides: dict[str, Any] | None = None) -> Recipe:
    scheme = create_scheme(variant)
    return replace(scheme.default_recipe, **(overrides or {}))


def variant_inputs(storage: Storage, slug: str, recipe: Recipe) -> dict[str, Any]:
    return inputs_of(storage.base_dir(slug), recipe)


def inputs_of(base_dir: Path, recipe: Recipe) -> dict[str, Any]:
    """What a variant is made from (hashed: its memoization key, and its manifest's)."""
    base = verify_artifact(base_dir)
    inputs: dict[str, Any] = {
        "stage": "optimize",
        "code": OPTIMIZE_CODE_VERSION,
        "base": base.inputs_hash,
        "recipe": recipe.to_dict(),
        "tools": tool_versions("llmcompressor", "compressed-tensors", "transformers"),
    }
    if recipe.num_calibration_samples:
        inputs["calibration"] = corpus_hash()
    return inputs


def is_done(storage: Storage, slug: str, variant: str, inputs_hash: str) -> bool:
    """Whether the variant is published from these inputs and its files are intact (a
    damaged one is made again)."""
    manifest = intact_artifact(storage.variant_dir(slug, variant))
    return manifest is not None and manifest.inputs_hash == inputs_hash


def _worker_init(parent_pid: int, log_path: str | None) -> None:
    """Worker processes die with their parent (a `kill -9` of the run must not leave a
    worker holding a variant's lock, or publishing it later), and write their output to
    the step's log."""
    import sys

    die_with_parent(parent_pid, signal.SIGKILL)
    if log_path is not None:
        handle = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the worker
        os.dup2(handle.fileno(), 1)
        os.dup2(handle.fileno(), 2)
        sys.stdout = sys.stderr = handle


def run_variant(
    root: str, slug: str, recipe: Recipe, inputs_hash: str, num_threads: int
) -> VariantResult:
    """One job (runs in a worker process): make one variant unless it is already there.

    `inputs_hash` is `hash_inputs(variant_inputs(...))`, computed once by the caller; it is
    checked again under the lock, since another run may have finished the variant since.
    """
    import torch

    torch.set_num_threads(num_threads)
    started = time.perf_counter()
    storage = Storage(root)
    target = storage.variant_dir(slug, recipe.scheme)
    with storage.lock(target):
        if is_done(storage, slug, recipe.scheme, inputs_hash):
            return VariantResult(recipe.scheme, target, True, time.perf_counter() - started)
        base = storage.base_dir(slug)
        scheme = create_scheme(recipe.scheme)
        extra: dict[str, Any] = {"variant": recipe.scheme, "recipe": recipe.to_dict()}
        with storage.publish(
            target,
            kind="optimized",
            source=str(base),
            revision=read_manifest(base).revision,
            inputs_hash=inputs_hash,
            tools=("torch", "transformers", "llmcompressor", "compressed-tensors"),
            extra=extra,  # read when the manifest is written, after the body
        ) as staging:
            extra["facts"] = scheme.run(recipe, base, staging)
    return VariantResult(recipe.scheme, target, False, time.perf_counter() - started)


def optimize(
    storage: Storage,
    slug: str,
    variants: list[str],
    *,
    max_parallel: int | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    on_done=None,
    num_threads: int | None = None,
    log_path: Path | None = None,
) -> list[VariantResult]:
    """Make `variants` of `models/<slug>/base` in parallel processes; raise if any failed.

    Each worker uses `num_threads` torch threads (default: the cores shared out)."""
    recipes = [recipe_for(v, (overrides or {}).get(v)) for v in variants]
    verify_artifact(storage.base_dir(slug))  # fail fast, naming the path, before forking
    results: list[VariantResult] = []
    failures: list[str] = []
    pending = []
    for recipe in recipes:  # finished variants need no worker process at all
        inputs_hash = hash_inputs(variant_inputs(storage, slug, recipe))
        if is_done(storage, slug, recipe.scheme, inputs_hash):
            results.append(
                VariantResult(recipe.scheme, storage.variant_dir(slug, recipe.scheme), True, 0.0)
            )
        else:
            pending.append((recipe, inputs_hash))
    if not pending:
        return sorted(results, key=lambda r: variants.index(r.variant))
    cores = os.cpu_count() or 1
    workers = max(1, min(max_parallel or cores, len(pending)))
    threads = num_threads or max(1, cores // workers)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=workers,
        mp_context=context,
        initializer=_worker_init,
        initargs=(os.getpid(), str(log_path) if log_path else None),
    ) as pool:
        futures = {
            pool.submit(
                run_variant, str(storage.root), slug, recipe, inputs_hash, threads
            ): recipe.scheme
            for recipe, inputs_hash in pending
        }
        for future in as_completed(futures):
            variant = futures[future]
            try:
                result = future.result()
            except BrokenProcessPool:
                raise  # a worker died (killed, out of memory): transient, the caller may retry
            except Exception as exc:
                failures.append(f"{variant}: {type(exc).__name__}: {exc}")
                continue
            results.append(result)
            if on_done is not None:
                on_done(result)
    if failures:
        raise PipelineError("optimize failed for " + "; ".join(failures))
    return sorted(results, key=lambda r: variants.index(r.variant))
