"""Tenants' quotas in a real Redis-protocol server (`gateway/redis_state.py`): two
`RedisTenantState`s on one server stand for two gateway replicas, and what one takes the
other sees (concurrency slots, tokens-per-minute reservations and their refunds); a
gateway that dies holding slots gives them back after their lease."""

from __future__ import annotations

import asyncio

import pytest
import redis
from prometheus_client import CollectorRegistry, Counter

from modelship.gateway import RefusalReason, Tenant, TenantConfig, hash_api_key
from modelship.gateway.redis_state import RedisTenantState
from modelship.gateway.tenant_state import LocalTenantState
from redis_process import RedisProcess

pytestmark = pytest.mark.timeout(120)


def make_tenant(name: str, **limits) -> Tenant:
    config = TenantConfig(name=name, api_key_sha256=hash_api_key(f"sk-{name}"), **limits)
    return Tenant(config.name, config)


def gateways(
    url: str, num: int = 2, slot_lease_s: float = 600.0, registry: CollectorRegistry | None = None
) -> list[RedisTenantState]:
    failures = Counter("state_failures", "", ["operation"], registry=registry)
    return [
        RedisTenantState(url, fail_open=False, failures=failures, slot_lease_s=slot_lease_s)
        for _ in range(num)
    ]


def test_concurrency_slots_are_shared_and_given_back(redis_server: RedisProcess) -> None:
    tenant = make_tenant("slots", max_concurrent=3)

    async def scenario() -> None:
        a, b = gateways(redis_server.url)
        first = await a.admit(tenant, "m", 10, 8, num_sequences=2)
        second = await b.admit(tenant, "m", 10, 8)
        assert first.ok and second.ok and first.hold_id != second.hold_id
        refused = await a.admit(tenant, "m", 10, 8)  # 3 held across the two gateways
        assert (refused.ok, refused.status_code) == (False, 429)
        assert refused.reason is RefusalReason.MAX_CONCURRENT
        assert refused.message == "at most 3 concurrent requests"
        a.settle(tenant, first, -10, 2)  # gateway a's request ends: both its slots back
        await a.settled()
        assert (await b.admit(tenant, "m", 10, 8, num_sequences=2)).ok
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_token_reservations_are_shared_and_refunds_reach_every_gateway(
    redis_server: RedisProcess,
) -> None:
    tenant = make_tenant("metered", tokens_per_minute=100)

    async def scenario() -> None:
        a, b = gateways(redis_server.url)
        taken = await a.admit(tenant, "m", 20, 40)  # 20 in + 40 out reserved
        assert taken.ok and taken.num_reserved_tokens == 60
        waits = await b.admit(tenant, "m", 20, 40)  # 40 left
        assert (waits.status_code, waits.reason) == (429, RefusalReason.TOKENS_PER_MINUTE)
        # 20 tokens missing, refilled at 100/min: about 12 s (the store's clock has moved on
        # a little since).
        assert 10.0 < waits.retry_after_s <= 12.0
        a.settle(tenant, taken, -30, 1)  # it used 30 of its 60
        await a.settled()
        assert (await b.admit(tenant, "m", 20, 40)).ok  # 70 left: fits
        never = await b.admit(tenant, "m", 20, 90)  # 110 > the whole quota: a 400
        assert (never.status_code, never.param) == (400, "max_tokens")
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_requests_per_minute_answer_as_the_local_limiter_does(redis_server: RedisProcess) -> None:
    tenant = make_tenant("rpm", requests_per_minute=3)

    async def answers(states: list) -> list[tuple[bool, int, str]]:
        decisions = [await state.admit(tenant, "m", 5, 5) for state in states]
        return [(d.ok, d.status_code, d.message) for d in decisions]

    async def scenario() -> None:
        a, b = gateways(redis_server.url)
        shared = await answers([a, a, b, b, b])
        local = await answers([LocalTenantState()] * 5)
        assert shared == local  # 3 admitted, then "at most 3 requests per minute" (429)
        assert local[3] == (False, 429, "at most 3 requests per minute")
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_a_dead_gateways_slots_come_back_after_their_lease(redis_server: RedisProcess) -> None:
    tenant = make_tenant("lease", max_concurrent=1)

    async def scenario() -> None:
        dead, alive = gateways(redis_server.url, slot_lease_s=1.0)
        assert (await dead.admit(tenant, "m", 1, 1)).ok  # never settled: its gateway died
        await dead.close()
        assert not (await alive.admit(tenant, "m", 1, 1)).ok
        for _ in range(100):  # the lease is 1 s; bounded at 10 s
            if (await alive.admit(tenant, "m", 1, 1)).ok:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the dead gateway's slot never came back")
        await alive.close()

    asyncio.run(scenario())


def test_a_tenant_without_quotas_never_reaches_the_store() -> None:
    # A store that is not running: a tenant with no quota is admitted all the same.
    tenant = make_tenant("free", max_output_tokens=16)

    async def scenario() -> None:
        (state,) = gateways("redis://127.0.0.1:9/0", num=1)  # the discard port: nothing there
        decision = await state.admit(tenant, "m", 4, None)
        assert decision.ok and decision.max_tokens == 16 and decision.hold_id == ""
        assert decision.num_reserved_tokens == 4 + 16
        await state.close()

    asyncio.run(scenario())


def test_a_settle_that_failed_is_sent_again_and_applied_once(redis_server: RedisProcess) -> None:
    tenant = make_tenant("resent", tokens_per_minute=100, max_concurrent=1)

    async def scenario() -> None:
        registry = CollectorRegistry()
        a, b = gateways(redis_server.url, registry=registry)
        a.settle_retry_delays_s = (0.5,) * 8  # bounded: 4 s
        taken = await a.admit(tenant, "m", 20, 40)  # 60 of 100 reserved, the one slot
        assert taken.ok
        # The store takes no writes for 1.5 s: the settle times out (0.5 s) and is sent
        # again until it lands.
        pause = redis.Redis(port=redis_server.port)
        pause.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
        pause.close()
        a.settle(tenant, taken, -30, 1)  # used 30 of its 60: 70 left once applied
        await a.settled()
        a.settle(tenant, taken, -30, 1)  # and once more, as a timed-out one that had run
        await a.settled()
        assert registry.get_sample_value("state_failures_total", {"operation": "settle"}) >= 1
        assert (await b.admit(tenant, "m", 10, 10)).ok  # the slot came back; 50 left
        refused = await b.admit(tenant, "m", 10, 0)  # the slot is b's now
        assert refused.reason is RefusalReason.MAX_CONCURRENT
        await b.close()
        (c,) = gateways(redis_server.url, num=1)
        # Refunded once: about 50 left, 75 do not fit (refunded twice, 80 would: 75 does).
        over = await c.admit(make_tenant("resent", tokens_per_minute=100), "m", 20, 55)
        assert over.reason is RefusalReason.TOKENS_PER_MINUTE
        await a.close()
        await c.close()

    asyncio.run(scenario())
