"""The canary split and judge (pure, fake clock) and the release plan on storage."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelship.gateway.canary import (
    REFERENCE_PROMPT_TOKENS,
    CanaryJudge,
    Track,
    in_canary,
    judged_ttft,
)
from modelship.gateway.config import CanaryJudgeConfig, GatewayConfig, RequestLimitsConfig
from modelship.gateway.groups import CANARY, STABLE
from modelship.gateway.pool import EndpointPool
from modelship.gateway.request import parse_request
from modelship.gateway.service import GatewayService
from modelship.gateway.tenants import Tenant, TenantConfig, hash_api_key
from modelship.pipeline.errors import PipelineError
from modelship.release.traffic import end_canary, promote_canary, read_traffic, start_canary
from modelship.storage import Storage

from fleet_storage import publish_release


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_split_is_sticky_proportional_and_monotonic_in_weight():
    keys = [f"user-{i}" for i in range(4000)]
    at_10 = {k for k in keys if in_canary(k, 10)}
    at_30 = {k for k in keys if in_canary(k, 30)}
    assert 0.08 < len(at_10) / len(keys) < 0.12
    assert 0.27 < len(at_30) / len(keys) < 0.33
    assert at_10 <= at_30  # raising the weight only moves keys to the canary
    assert all(in_canary(k, 10) for k in at_10)  # same key, same side
    assert not any(in_canary(k, 0) for k in keys)


def judge(clock: Clock, num_tenants: int = 1, **overrides) -> CanaryJudge:
    settings = dict(window_s=60, min_requests=10, max_error_rate_margin=0.05,
                    max_ttft_p95_ratio=1.5, min_ttft_increase_s=0.05)  # fmt: skip
    settings.update(overrides)
    return CanaryJudge(CanaryJudgeConfig(**settings), clock=clock, num_tenants=num_tenants)


def feed(j: CanaryJudge, track: Track, n: int, ok: bool = True, ttft_s: float = 0.1) -> None:
    for _ in range(n):
        j.record(track, ok, ttft_s if ok else None)


def test_judge_waits_for_enough_requests_on_both_tracks():
    j = judge(Clock())
    feed(j, Track.STABLE, 50)
    feed(j, Track.CANARY, 9, ok=False)
    assert not j.verdict().rollback
    feed(j, Track.CANARY, 1, ok=False)
    verdict = j.verdict()
    assert verdict.rollback and "error rate" in verdict.reason


def test_judge_rolls_back_on_error_rate_margin_only():
    j = judge(Clock())
    feed(j, Track.STABLE, 95)
    feed(j, Track.STABLE, 5, ok=False)  # stable: 5% errors
    feed(j, Track.CANARY, 90)
    feed(j, Track.CANARY, 10, ok=False)  # canary: 10%, exactly the margin above
    assert not j.verdict().rollback
    feed(j, Track.CANARY, 1, ok=False)
    assert j.verdict().rollback


def test_judge_rolls_back_on_slow_canary_but_not_on_noise():
    j = judge(Clock())
    feed(j, Track.STABLE, 20, ttft_s=0.010)
    feed(j, Track.CANARY, 20, ttft_s=0.030)  # 3x slower, but only 20 ms: noise
    assert not j.verdict().rollback
    j.reset()
    feed(j, Track.STABLE, 20, ttft_s=0.100)
    feed(j, Track.CANARY, 20, ttft_s=0.140)  # +40 ms but only 1.4x
    assert not j.verdict().rollback
    feed(j, Track.CANARY, 20, ttft_s=0.400)
    verdict = j.verdict()
    assert verdict.rollback and "TTFT" in verdict.reason
    assert verdict.canary.ttft_p95_s == pytest.approx(0.4)


def test_one_tenant_alone_cannot_roll_a_canary_back():
    """Tenant a, slow on the canary by its own doing (or only on its requests), while
    tenant b finds it as fast as stable: no rollback on a gateway of two tenants."""

    def attacked(j: CanaryJudge) -> CanaryJudge:
        for tenant in ("a", "b"):
            for _ in range(20):
                j.record(Track.STABLE, True, 0.1, tenant)
        for _ in range(10):
            j.record(Track.CANARY, True, 0.1, "b")
        for _ in range(30):
            j.record(Track.CANARY, True, 3.0, "a")
        return j

    j = attacked(judge(Clock(), num_tenants=2))
    verdict = j.verdict()
    assert not verdict.rollback and "without one tenant" in verdict.reason
    # The same traffic on a gateway of one tenant (no other to protect): rolled back.
    assert attacked(judge(Clock())).verdict().rollback
    # Slow for both tenants: rolled back.
    for _ in range(10):
        j.record(Track.CANARY, True, 3.0, "b")
    assert j.verdict().rollback


def test_one_tenant_alone_cannot_fail_a_canary_either():
    j = judge(Clock(), num_tenants=3)
    for tenant in ("a", "b"):
        for _ in range(20):
            j.record(Track.STABLE, True, 0.1, tenant)
            j.record(Track.CANARY, True, 0.1, tenant)
    for _ in range(20):
        j.record(Track.CANARY, False, None, "a")
    assert not j.verdict().rollback
    for _ in range(20):
        j.record(Track.CANARY, False, None, "b")
    assert j.verdict().rollback


def test_judged_ttft_scales_long_prompts_down():
    assert judged_ttft(0.2, 100) == pytest.approx(0.2)  # short prompts as they are
    assert judged_ttft(0.2, REFERENCE_PROMPT_TOKENS) == pytest.approx(0.2)
    assert judged_ttft(0.8, 4 * REFERENCE_PROMPT_TOKENS) == pytest.approx(0.2)


def test_judge_forgets_outside_the_window():
    clock = Clock()
    j = judge(clock)
    feed(j, Track.STABLE, 20)
    feed(j, Track.CANARY, 20, ok=False)
    clock.now = 61.0
    feed(j, Track.STABLE, 20)
    feed(j, Track.CANARY, 20)
    verdict = j.verdict()
    assert not verdict.rollback
    assert verdict.canary.num_requests == 20 and verdict.canary.error_rate == 0


@pytest.fixture
def storage(tmp_path: Path, tiny_llama_dir: Path) -> Storage:
    storage = Storage(tmp_path / "storage")
    for variant in ("fp16", "gptq"):
        publish_release(storage, "m", tiny_llama_dir, variant)
    storage.set_production("m", 1)
    return storage


def test_release_plan_canary_promote_and_rollback(storage: Storage):
    assert read_traffic(storage, "m").canary is None
    plan = start_canary(storage, "m", 2, 10)
    assert (plan.canary.release, plan.canary.weight) == (2, 10)
    assert read_traffic(storage, "m").canary == plan.canary
    assert promote_canary(storage, "m") == (1, 2)
    assert storage.production_release("m") == 2
    assert read_traffic(storage, "m").canary is None
    start_canary(storage, "m", 1, 50)
    assert end_canary(storage, "m", "too slow", automatic=True) == 1
    assert end_canary(storage, "m", "again") is None
    events = read_traffic(storage, "m").events
    assert [e["action"] for e in events] == ["canary", "promote", "canary", "auto_rollback"]
    assert events[-1]["reason"] == "too slow"


@pytest.mark.parametrize(
    ("release", "weight", "message"),
    [(3, 10, "release 3 does not exist"), (1, 10, "already production"), (2, 100, "between 1")],
)
def test_release_plan_refuses_bad_canaries(storage: Storage, release, weight, message):
    with pytest.raises(PipelineError, match=message):
        start_canary(storage, "m", release, weight)
    assert not (storage.model_dir("m") / "traffic.json").exists()


def test_promote_without_canary_is_an_error(storage: Storage):
    with pytest.raises(PipelineError, match="no canary"):
        promote_canary(storage, "m")


def test_a_client_cannot_choose_its_track_by_session_id():
    config = GatewayConfig()
    pool = EndpointPool(config.resilience)
    pool.add("stable-0", "http://127.0.0.1:1", STABLE, "1")
    pool.add("canary-0", "http://127.0.0.1:2", CANARY, "2")
    service = GatewayService(config, pool, canary_weight=30)
    tenant = Tenant("acme", TenantConfig(name="acme", api_key_sha256=hash_api_key("sk-acme")))
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'

    def track(session_id: str, gateway: GatewayService = service) -> Track:
        parsed = parse_request(body, "/v1/chat/completions", session_id, RequestLimitsConfig())
        return gateway.pick_track(parsed, tenant, "request-id")

    # Session ids a client picked because the public hash puts them on the canary.
    aimed = [s for s in (f"s{i}" for i in range(400)) if in_canary(f"session:{s}", 30)][:20]
    assert len(aimed) == 20
    tracks = [track(s) for s in aimed]
    assert tracks.count(Track.CANARY) < 20  # about 30% land there, as any session would
    assert [track(s) for s in aimed] == tracks  # still sticky
    other = GatewayService(config, pool, canary_weight=30)  # another secret, another split
    assert [track(s, other) for s in aimed] != tracks


def test_a_promoted_canary_is_not_judged():
    """After a promotion a standalone gateway sends the canary track everything (weight
    100, `fleet/plan_follower.py`): stable sees only fallbacks, nothing to compare with, so
    the judge stays out; at 99 it still judges."""
    config = GatewayConfig(canary=CanaryJudgeConfig(min_requests=2))
    pool = EndpointPool(config.resilience)
    pool.add("stable-0", "http://127.0.0.1:1", STABLE, "1")
    pool.add("canary-0", "http://127.0.0.1:2", CANARY, "2")
    for weight, judged in ((100, False), (99, True)):
        split = GatewayService(config, pool, canary_weight=weight).canary
        rolled_back = []
        split.on_rollback = rolled_back.append
        for _ in range(3):
            split.record(Track.STABLE, ok=True, ttft_s=0.1, tenant="t")
            split.record(Track.CANARY, ok=False, ttft_s=None, tenant="t")
        assert (split.weight == 0) is judged and bool(rolled_back) is judged
