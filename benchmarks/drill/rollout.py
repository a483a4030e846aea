"""Drill 5, rollout: bad canary releases are rolled back on their own while production
goes on untouched.

`modelship up` serves release 1; client threads (the `openai` SDK, retries off, a new
`user` per request so the sticky split sends about half of them to the canary) run the
whole time. Each case publishes a bad release and starts it as a canary at 50% with the
real CLI (`modelship release canary`); pass rules: `traffic.json` records an automatic
rollback of that release within the judge window, the canary replica is drained, and
every client request succeeds (the canary's failures are retried on stable).

- nan_layer: one decoder layer's weights multiplied by NaN (every output NaN); the
  replica's warm-up already fails, so the canary never serves: it must be rolled back
  for failing to start, not left restarting forever.
- nan_tokens: NaN only in the embedding rows of the ids real prompts use (the warm-up
  prompt's first ids stay intact): the replica starts and every real request yields NaN
  logits; the judge must see errors, never text sampled from NaN.
- slow (full version): a bigger model under the same tokenizer, several times slower
  per token; rolled back on TTFT p95. No serve flag slows one release alone (engine
  options apply to every replica of the fleet), so the slowness is real weights.

Figures: time from `release canary` to the rollback per case, requests sent / succeeded
/ failed, and how many the canary answered.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modelship.release.traffic import read_traffic
from modelship.storage import Storage

from drill.common import DrillContext, DrillResult, wait_until
from drill.traffic import Traffic, describe, tally
from fleet_process import UpProcess
from fleet_storage import publish_release
from tiny_models import make_tiny_llama

SLUG = "drill"
WEIGHT = 50
WARMUP_IDS = 4  # the replica's warm-up prompt is token ids 0..3 (server/app.py)


def run(context: DrillContext) -> DrillResult:
    result = DrillResult("rollout")
    storage = Storage(context.work_dir / "storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, context.model_dir, "fp16"))
    cases = {
        "nan_layer": _nan_layer(context.model_dir, context.work_dir / "nan_layer"),
        "nan_tokens": _nan_tokens(context.model_dir, context.work_dir / "nan_tokens"),
    }
    if not context.quick:
        cases["slow"] = _slow(context.model_dir, context.work_dir / "slow")
    releases = {
        case: publish_release(storage, SLUG, folder, case) for case, folder in cases.items()
    }
    window_s = 90.0 if context.quick else 180.0
    config = {
        "serve": {"engine": {"max_model_len": 256, "kv_cache_memory_mb": 16},
                  "grace_period_s": 10},
        "gateway": {
            "routing": {"policy": "round_robin"},
            "canary": {"min_requests": 6, "window_s": window_s, "max_error_rate_margin": 0.1,
                       "max_ttft_p95_ratio": 2.0, "min_ttft_increase_s": 0.05},
            "resilience": {"breaker_failure_threshold": 2, "breaker_cool_down_s": 5,
                           "request_timeout_s": 30, "health_check_interval_s": 0.5},
        },
        "autoscale": {"min_replicas": 1, "max_replicas": 1, "restart_backoff_s": 0.5,
                      "tick_s": 0.25},
    }  # fmt: skip
    (context.work_dir / "up").mkdir(exist_ok=True)
    up = UpProcess(config, storage.root, SLUG, context.work_dir / "up")
    try:
        up.wait_ready(timeout_s=240)
        traffic = Traffic(up.url, SLUG, num_threads=4, max_tokens=8, timeout_s=60, pause_s=0.05)
        traffic.start()
        try:
            traffic.wait_ok(8, 120)
            for case, release in releases.items():
                _canary(up, storage, case, release, window_s, traffic, result)
            traffic.wait_ok(8, 60)
        finally:
            outcomes = traffic.stop()
    finally:
        code = up.stop()
    counts = tally(outcomes)
    result.figures.update(sent=counts["sent"], ok=counts["ok"], failed=counts["failed"])
    production = [o for o in outcomes if o.release == "1"]
    result.check(
        "production: every request succeeds",
        outcomes and all(o.ok for o in outcomes),
        describe(outcomes),
    )
    result.check(
        "production: release 1 answered all along",
        len(production) >= counts["ok"] // 2,
        f"{len(production)} of {counts['ok']} answered by release 1",
    )
    result.check("modelship up stops cleanly", code == 0, f"exit {code}")
    return result


def _canary(
    up: UpProcess,
    storage: Storage,
    case: str,
    release: int,
    window_s: float,
    traffic: Traffic,
    result: DrillResult,
) -> None:
    before = len(traffic.snapshot())
    started_at = time.monotonic()
    command = up.cli("release", "canary", "--release", str(release), "--weight", str(WEIGHT))
    if not result.check(f"{case}: canary started", command.returncode == 0, command.stderr):
        return

    def rolled_back() -> dict | None:
        events = read_traffic(storage, SLUG).events
        return next(
            (
                e
                for e in events
                if e.get("action") == "auto_rollback" and e.get("release") == release
            ),
            None,
        )

    rolled = wait_until(lambda: rolled_back() is not None, window_s + 30, 0.1)
    seconds = time.monotonic() - started_at
    event = rolled_back() or {}
    result.figures[f"{case}_time_to_rollback_s"] = round(seconds, 1) if rolled else None
    answered = [o for o in traffic.snapshot()[before:] if o.release == str(release)]
    result.figures[f"{case}_canary_answered"] = len(answered)
    result.check(
        f"{case}: rolled back automatically within the judge window",
        rolled and seconds <= window_s,
        f"{seconds:.0f}s; plan {read_traffic(storage, SLUG)}",
    )
    result.figures[f"{case}_reason"] = event.get("reason", "")
    if case.startswith("nan"):
        result.check(
            f"{case}: no text sampled from NaN reached a client",
            all(not o.ok for o in answered),
            describe(answered),
        )
    drained = wait_until(lambda: up.metric("modelship_gateway_replicas", track="canary") == 0, 60)
    result.check(f"{case}: the canary replica is drained", drained)


# Bad releases ------------------------------------------------------------------------------
def _copy(model_dir: Path, folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(model_dir, folder)
    return folder


def _edit_weights(folder: Path, edit) -> None:
    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(path)
        if edit(tensors):
            save_file(tensors, path, metadata={"format": "pt"})


def _nan_layer(model_dir: Path, folder: Path) -> Path:
    """Every weight of the last decoder layer's MLP multiplied by NaN."""
    _copy(model_dir, folder)

    def edit(tensors: dict[str, torch.Tensor]) -> bool:
        layers = {int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")}
        prefix = f"model.layers.{max(layers)}.mlp." if layers else None
        names = [n for n in tensors if prefix and n.startswith(prefix)]
        for name in names:
            tensors[name] = tensors[name] * float("nan")
        return bool(names)

    _edit_weights(folder, edit)
    return folder


def _nan_tokens(model_dir: Path, folder: Path) -> Path:
    """NaN embedding rows for every id past the warm-up prompt's."""
    _copy(model_dir, folder)

    def edit(tensors: dict[str, torch.Tensor]) -> bool:
        name = "model.embed_tokens.weight"
        if name not in tensors:
            return False
        tensors[name] = tensors[name].clone()
        tensors[name][WARMUP_IDS:] = float("nan")
        return True

    _edit_weights(folder, edit)
    return folder


def _slow(model_dir: Path, folder: Path) -> Path:
    """A much bigger Llama with the same tokenizer (the tiny test model's shape grown;
    for another model, its own config grown the same way)."""
    if folder.exists():
        shutil.rmtree(folder)
    return make_tiny_llama(
        folder, seed=2, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4,
    )  # fmt: skip
