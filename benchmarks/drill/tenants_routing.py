"""Drill 7's second fleet: what one tenant can learn or do to another through the gateway's
routing, tiers and canary (issue 28, items 3 to 6). `modelship up` with tenants A (normal
priority) and C (low priority, a tier rule sends its short requests to the `economy` tier),
a metrics key, an economy tier replica, and a canary of a second release at 50%:

- without the metrics key /metrics shows the fleet's health, the replicas' engine load
  summed over them included, and nothing that moves per request (routing reasons, usage);
- A resending C's prompt is no affinity hit (the routing reason would confirm a guess at
  C's prompt), while C's own resend is;
- C naming the primary tier (`x-modelship-tier: primary`) still gets the economy tier its
  rule gives it (`denied`);
- C, aiming long non-streaming answers at its canary sessions and one-token ones at its
  stable sessions (the drill knows the split's secret: C stands for a tenant that found
  them), does not roll the healthy canary back; no answer tells C which release served it.
"""

from __future__ import annotations

import hashlib

import httpx

from modelship.gateway import hash_api_key
from modelship.gateway.canary import in_canary
from modelship.storage import Storage

from drill.common import DrillContext, DrillResult
from fleet_process import UpProcess
from fleet_storage import publish_release, publish_variant

SLUG = "drill"
KEY_A, KEY_C, METRICS_KEY = "sk-drill-route-a-0123", "sk-drill-route-c-4567", "sk-drill-rm-89"
SPLIT_SECRET = "drill-split-secret-0123456789"
DECISIONS = "modelship_gateway_routing_decisions_total"
SECRET_PROMPT = "Tenant C's launch code is 7-4-1-1 and its vault opens at dawn. " * 3


def run_routing(context: DrillContext, result: DrillResult) -> None:
    """Start the second fleet, run its cases into `result`, stop it."""
    storage = Storage(context.work_dir / "routing-storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, context.model_dir, "fp16"))
    canary = publish_release(storage, SLUG, context.model_dir, "fp16")  # healthy: the same
    publish_variant(storage, SLUG, context.model_dir, "int4")
    config = {
        "serve": {"engine": {"max_model_len": 256, "kv_cache_memory_mb": 16}},
        "gateway": {
            "tenants": [
                {"name": "a", "api_key_sha256": hash_api_key(KEY_A)},
                {"name": "c", "api_key_sha256": hash_api_key(KEY_C), "priority": "low"},
            ],
            "metrics_api_key_sha256": hash_api_key(METRICS_KEY),
            "tiers": [{"name": "economy", "variant": "int4"}],
            "tier_rules": [{"name": "short", "tier": "economy", "max_output_tokens": 4,
                            "priorities": ["low"]}],
            "canary": {"split_secret": SPLIT_SECRET, "min_requests": 4, "window_s": 600,
                       "max_ttft_p95_ratio": 1.5, "min_ttft_increase_s": 0.02},
            "drift_probe": {"enabled": False},
        },
        "autoscale": {"min_replicas": 1, "max_replicas": 1},
    }  # fmt: skip
    workdir = context.work_dir / "routing"
    workdir.mkdir(parents=True, exist_ok=True)
    up = UpProcess(config, storage.root, SLUG, workdir)
    try:
        up.wait_ready(timeout_s=180)
        up.metrics_key = METRICS_KEY
        _public_metrics(up, result)
        _routing_memory(up, result)
        _named_tier(up, result)
        _canary(up, result, canary)
    finally:
        code = up.stop()
    result.check("the routing fleet stops cleanly", code == 0, f"exit {code}")


def _post(up: UpProcess, key: str, max_tokens: int, prompt: str = "Hello", **headers: str):
    body = {"model": SLUG, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if max_tokens > 8:
        body["ignore_eos"] = True  # the whole length: a slow answer
    return httpx.post(f"{up.url}/v1/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {key}", **headers})  # fmt: skip


def _public_metrics(up: UpProcess, result: DrillResult) -> None:
    answered = _post(up, KEY_A, 6)
    if not result.check("A is answered", answered.status_code == 200, answered.text[:200]):
        return
    up.wait_for(
        lambda: "modelship_gateway_replica_generation_tokens_total{" in _public(up),
        30, "the replicas' engine series on the gateway",
    )  # fmt: skip
    public = _public(up)
    per_request = ("routing_decisions", "tokens_total", "cost_total", "requests_total",
                   "tier_decisions", "request_duration_seconds")  # fmt: skip
    leaked = [name for name in per_request if f"modelship_gateway_{name}" in public]
    leaked += ["tenant label"] if 'tenant="' in public else []
    result.check(
        "/metrics without a key: the fleet and its engines' load, nothing per request",
        not leaked and "modelship_gateway_replica_num_requests_running{" in public,
        f"per-request series found: {leaked}",
    )


def _public(up: UpProcess) -> str:
    return httpx.get(f"{up.url}/metrics", timeout=10).text


def _routing_memory(up: UpProcess, result: DrillResult) -> None:
    # max_tokens 8: C's request stays on the primary (its rule takes only up to 4).
    codes = [_post(up, KEY_C, 8, SECRET_PROMPT).status_code]
    before = up.metric(DECISIONS, reason="affinity_hit")
    codes.append(_post(up, KEY_A, 8, SECRET_PROMPT).status_code)  # A's guess at C's prompt
    guessed = up.metric(DECISIONS, reason="affinity_hit")
    codes.append(_post(up, KEY_C, 8, SECRET_PROMPT).status_code)
    own = up.metric(DECISIONS, reason="affinity_hit")
    result.check(
        "A resending C's prompt is no affinity hit; C's own resend is",
        codes == [200] * 3 and guessed == before and own == before + 1,
        f"statuses {codes}; affinity hits {before} -> {guessed} (A) -> {own} (C)",
    )


def _named_tier(up: UpProcess, result: DrillResult) -> None:
    up.wait_for(
        lambda: up.metric("modelship_gateway_replicas", track="economy", state="ready") == 1,
        120, "the economy tier's replica",
    )  # fmt: skip
    asked = _post(up, KEY_C, 4, **{"x-modelship-tier": "primary"})
    denied = up.metric("modelship_gateway_tier_decisions_total", reason="denied")
    result.check(
        "C naming the primary tier still gets the economy tier its rule gives it",
        asked.status_code == 200 and asked.headers.get("x-modelship-tier") == "economy"
        and denied == 1,
        f"{asked.status_code}, tier {asked.headers.get('x-modelship-tier')}, denied {denied}",
    )  # fmt: skip


def _canary(up: UpProcess, result: DrillResult, release: int) -> None:
    started = up.cli("release", "canary", "--release", str(release), "--weight", "50")
    if not result.check("the healthy canary starts", started.returncode == 0, started.stderr):
        return
    up.wait_for(
        lambda: up.metric("modelship_gateway_replicas", track="canary", state="ready") == 1
        and up.metric("modelship_gateway_canary_weight") == 50,
        120, "the canary replica",
    )  # fmt: skip
    split_key = hashlib.sha256(SPLIT_SECRET.encode()).digest()
    sessions: dict[bool, list[str]] = {True: [], False: []}
    for i in range(60):
        sessions[in_canary(f"c\nsession:s{i}", 50, split_key)].append(f"s{i}")
    told = []
    for on_canary, on_stable in zip(sessions[True][:6], sessions[False][:6], strict=True):
        slow = _post(up, KEY_C, 60, **{"x-session-id": on_canary})
        fast = _post(up, KEY_C, 5, **{"x-session-id": on_stable})  # 5: past its tier rule
        told += [r.headers.get("x-modelship-release") for r in (slow, fast)]
    rollbacks = up.metric("modelship_gateway_canary_rollbacks_total")
    weight = up.metric("modelship_gateway_canary_weight")
    result.check(
        "C's slow answers on its canary sessions do not roll the healthy canary back",
        rollbacks == 0 and weight == 50,
        f"rollbacks {rollbacks}, canary weight {weight}",
    )
    result.check(
        "no answer tells C which release served it",
        told == [None] * len(told),
        f"x-modelship-release: {sorted({str(t) for t in told})}",
    )
