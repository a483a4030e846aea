"""Tenants: key hashing and authentication, token buckets, per-tenant limits."""

from __future__ import annotations

import hmac
import math

import pytest
from pydantic import ValidationError

from modelship.gateway import (
    Priority,
    RefusalReason,
    Tenant,
    TenantConfig,
    TenantLimiter,
    TenantRegistry,
    TokenBucket,
    hash_api_key,
)
from modelship.gateway import tenants as tenants_module


def make_tenant(**limits) -> Tenant:
    config = TenantConfig(name="acme", api_key_sha256=hash_api_key("sk-acme"), **limits)
    return Tenant(config.name, config)


# --- keys and authentication -----------------------------------------------------------


def test_hash_api_key_is_sha256_hex() -> None:
    expected = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert hash_api_key("abc") == expected


def test_config_takes_one_or_many_digests_and_checks_them() -> None:
    one = TenantConfig(name="a", api_key_sha256=hash_api_key("k1"))
    assert one.api_key_sha256 == [hash_api_key("k1")]
    assert one.priority_level is Priority.NORMAL
    assert (
        TenantConfig(name="b", api_key_sha256=[hash_api_key("k")], priority="low").priority_level
        == Priority.LOW
    )
    with pytest.raises(ValidationError) as error:
        TenantConfig(name="c", api_key_sha256="sk-live-secret")
    assert "sk-live-secret" not in str(error.value)  # a pasted key is never echoed
    with pytest.raises(ValidationError, match="extra"):
        TenantConfig(name="d", api_key_sha256=hash_api_key("k"), rpm=5)


def test_registry_authenticates_by_hash() -> None:
    registry = TenantRegistry(
        [
            TenantConfig(name="acme", api_key_sha256=[hash_api_key("old"), hash_api_key("new")]),
            TenantConfig(name="beta", api_key_sha256=hash_api_key("beta-key")),
        ]
    )
    assert registry.authenticate("old").name == "acme"
    assert registry.authenticate("new").name == "acme"
    assert registry.authenticate("beta-key").name == "beta"
    assert registry.authenticate("wrong") is None
    assert registry.authenticate(hash_api_key("beta-key")) is None  # the digest is no key
    assert registry.get("beta").name == "beta" and len(registry) == 2


def test_authenticate_compares_every_digest_in_constant_time(monkeypatch) -> None:
    calls = []
    real_compare = hmac.compare_digest

    def counting_compare(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real_compare(a, b)

    registry = TenantRegistry(
        [TenantConfig(name=f"t{i}", api_key_sha256=hash_api_key(f"k{i}")) for i in range(3)]
    )
    monkeypatch.setattr(tenants_module.hmac, "compare_digest", counting_compare)
    assert registry.authenticate("k0").name == "t0"
    assert len(calls) == 3  # no early exit on the first match


def test_registry_rejects_duplicates() -> None:
    digest = hash_api_key("k")
    with pytest.raises(ValueError, match="configured twice"):
        TenantRegistry([TenantConfig(name="a", api_key_sha256=digest)] * 2)
    with pytest.raises(ValueError, match="reuses another tenant's key"):
        TenantRegistry(
            [
                TenantConfig(name="a", api_key_sha256=digest),
                TenantConfig(name="b", api_key_sha256=digest),
            ]
        )


# --- token bucket ----------------------------------------------------------------------


def test_bucket_refills_and_says_when_to_retry() -> None:
    bucket = TokenBucket(capacity=10, refill_per_s=2, now=0.0)
    assert bucket.try_take(10, now=0.0).ok
    refused = bucket.try_take(4, now=0.5)  # 1 token back, 3 missing at 2/s
    assert not refused.ok and refused.retry_after_s == pytest.approx(1.5)
    assert not bucket.try_take(4, now=1.99).ok
    assert bucket.try_take(4, now=2.0).ok
    assert bucket.level(now=1000.0) == 10  # never above capacity


def test_bucket_debt_delays_the_next_take() -> None:
    bucket = TokenBucket(capacity=10, refill_per_s=1, now=0.0)
    bucket.try_take(5, now=0.0)
    bucket.debit(15, now=0.0)  # output charged after the fact: level -10
    assert bucket.level(now=0.0) == -10
    assert bucket.try_take(1, now=0.0).retry_after_s == pytest.approx(11)
    assert math.isinf(bucket.try_take(11, now=0.0).retry_after_s)  # never fits


def test_bucket_ignores_a_clock_going_backwards() -> None:
    bucket = TokenBucket.per_minute(60, now=100.0)
    bucket.try_take(60, now=100.0)
    assert bucket.level(now=50.0) == 0
    assert bucket.level(now=101.0) == pytest.approx(1)


# --- limiter ---------------------------------------------------------------------------


def admit(limiter: TenantLimiter, tenant: Tenant, now: float = 0.0, **request):
    args = {"model": "demo", "input_tokens": 10, "max_tokens": 16} | request
    return limiter.admit(tenant, now=now, **args)


def test_requests_per_minute() -> None:
    limiter, tenant = TenantLimiter(), make_tenant(requests_per_minute=2)
    assert admit(limiter, tenant).ok and admit(limiter, tenant).ok
    refused = admit(limiter, tenant, now=1.0)
    assert refused.reason is RefusalReason.REQUESTS_PER_MINUTE
    assert refused.status_code == 429 and refused.retry_after_s == pytest.approx(29)
    assert admit(limiter, tenant, now=30.0).ok


def test_tokens_per_minute_reserve_the_output_bound_and_refund_what_went_unused() -> None:
    limiter, tenant = TenantLimiter(), make_tenant(tokens_per_minute=600)
    first = admit(limiter, tenant, input_tokens=100, max_tokens=150, num_sequences=2)
    assert first.ok and first.num_reserved_tokens == 400  # the input and n x max_tokens
    refused = admit(limiter, tenant, input_tokens=50, max_tokens=200)  # 250 of 200 left
    assert refused.reason is RefusalReason.TOKENS_PER_MINUTE and refused.status_code == 429
    assert refused.retry_after_s == pytest.approx(5)  # 50 missing at 10 tokens/s
    limiter.charge("acme", -200, now=0.0)  # it ended having used 200 of its 400
    assert admit(limiter, tenant, input_tokens=50, max_tokens=200).ok
    # Without max_tokens the tenant's cap bounds the output.
    capped = make_tenant(tokens_per_minute=600, max_output_tokens=100)
    assert admit(limiter, capped, input_tokens=10, max_tokens=None).num_reserved_tokens == 110


def test_an_unbounded_output_is_charged_after_the_fact() -> None:
    limiter, tenant = TenantLimiter(), make_tenant(tokens_per_minute=600)
    assert admit(limiter, tenant, input_tokens=400, max_tokens=None).num_reserved_tokens == 400
    limiter.charge("acme", 150, now=0.0)  # the response's output, charged at its end
    refused = admit(limiter, tenant, input_tokens=100, max_tokens=None)
    assert refused.reason is RefusalReason.TOKENS_PER_MINUTE and refused.status_code == 429
    assert refused.retry_after_s == pytest.approx(5)  # 50 missing at 10 tokens/s
    assert admit(limiter, tenant, now=5.0, input_tokens=100, max_tokens=None).ok


def test_charges_correct_the_admission_estimate_both_ways() -> None:
    limiter, tenant = TenantLimiter(), make_tenant(tokens_per_minute=600)
    assert admit(limiter, tenant, input_tokens=100, max_tokens=None).ok  # estimated
    limiter.charge("acme", -60, now=0.0)  # the replica counted 40
    limiter.charge("acme", -(10**6), now=0.0)  # a refund never fills past the capacity
    assert admit(limiter, tenant, input_tokens=600, max_tokens=None).ok
    limiter.charge("acme", 300, now=0.0)  # more than estimated, plus the output
    refused = admit(limiter, tenant, input_tokens=1, max_tokens=None)
    assert refused.reason is RefusalReason.TOKENS_PER_MINUTE


def test_prompt_larger_than_the_quota_is_a_bad_request() -> None:
    limiter, tenant = TenantLimiter(), make_tenant(tokens_per_minute=100)
    refused = admit(limiter, tenant, input_tokens=101)
    assert refused.reason is RefusalReason.TOKENS_PER_MINUTE
    assert refused.status_code == 400 and refused.retry_after_s is None
    # The input fits, its output's bound never could: lowering max_tokens would help.
    refused = admit(limiter, tenant, input_tokens=50, max_tokens=30, num_sequences=2)
    assert refused.status_code == 400 and refused.param == "max_tokens"
    assert "up to 60 output tokens" in refused.message


def test_a_refusal_takes_nothing() -> None:
    limiter, tenant = TenantLimiter(), make_tenant(requests_per_minute=2, tokens_per_minute=100)
    assert admit(limiter, tenant, input_tokens=60, max_tokens=20).ok
    refused = admit(limiter, tenant, input_tokens=60, max_tokens=20)
    assert refused.reason is RefusalReason.TOKENS_PER_MINUTE
    assert admit(limiter, tenant, input_tokens=10, max_tokens=5).ok  # it spent no request
    assert admit(limiter, tenant, input_tokens=1).reason is RefusalReason.REQUESTS_PER_MINUTE
    assert limiter.in_flight("acme") == 2


def test_max_concurrent_and_release() -> None:
    limiter = TenantLimiter(concurrency_retry_after_s=2.0)
    tenant = make_tenant(max_concurrent=2)
    assert admit(limiter, tenant).ok and admit(limiter, tenant).ok
    refused = admit(limiter, tenant)
    assert refused.reason is RefusalReason.MAX_CONCURRENT
    assert refused.status_code == 429 and refused.retry_after_s == 2.0
    limiter.release("acme")
    assert admit(limiter, tenant).ok
    for _ in range(5):
        limiter.release("acme")
    assert limiter.in_flight("acme") == 0


def test_every_sequence_takes_a_concurrency_slot() -> None:
    limiter, tenant = TenantLimiter(), make_tenant(max_concurrent=4)
    assert admit(limiter, tenant, num_sequences=3).ok
    assert limiter.in_flight("acme") == 3
    refused = admit(limiter, tenant, num_sequences=2)
    assert refused.reason is RefusalReason.MAX_CONCURRENT and refused.status_code == 429
    never = admit(limiter, tenant, num_sequences=5)  # could never fit: not worth a retry
    assert never.reason is RefusalReason.MAX_CONCURRENT and never.status_code == 400
    limiter.release("acme", num_sequences=3)
    assert admit(limiter, tenant, num_sequences=4).ok


def test_token_size_limits() -> None:
    limiter = TenantLimiter()
    tenant = make_tenant(max_input_tokens=100, max_output_tokens=50)
    refused = admit(limiter, tenant, input_tokens=101)
    assert refused.reason is RefusalReason.INPUT_TOO_LONG and refused.status_code == 400
    # An estimate (text) is left to the replica, which counts the tokens.
    assert admit(limiter, tenant, input_tokens=101, check_max_input=False).ok
    refused = admit(limiter, tenant, max_tokens=51)
    assert refused.reason is RefusalReason.MAX_TOKENS_TOO_LARGE and refused.status_code == 400
    assert admit(limiter, tenant, max_tokens=None).max_tokens == 50  # the tenant's cap
    assert admit(limiter, tenant, max_tokens=20).max_tokens == 20
    assert admit(limiter, make_tenant(), max_tokens=None).max_tokens is None


def test_model_allow_list() -> None:
    limiter = TenantLimiter()
    tenant = make_tenant(allowed_models=["demo"])
    assert admit(limiter, tenant, model="demo").ok
    refused = admit(limiter, tenant, model="other")
    assert refused.reason is RefusalReason.MODEL_NOT_ALLOWED and refused.status_code == 403
    assert admit(limiter, make_tenant(), model="anything").ok


def test_an_adapter_a_tenant_lists_is_private_to_the_tenants_listing_it() -> None:
    def config(name: str, **lists) -> TenantConfig:
        return TenantConfig(name=name, api_key_sha256=hash_api_key(f"sk-{name}"), **lists)

    registry = TenantRegistry([
        config("sales", allowed_adapters=["sales-bot"]),
        config("legal", allowed_models=["demo"], allowed_adapters=["contracts"]),
        config("open"),
        config("old", allowed_models=["demo", "summaries"]),
    ])  # fmt: skip
    sales, legal, open_, old = (registry.get(n) for n in ("sales", "legal", "open", "old"))
    assert sales.may_use("sales-bot") and sales.may_use("demo") and sales.may_use("summaries")
    assert not sales.may_use("contracts")  # another tenant's adapter, whatever else it may
    assert legal.may_use("contracts") and legal.may_use("demo") and not legal.may_use("x")
    assert not open_.may_use("sales-bot") and not open_.may_use("contracts")
    assert open_.may_use("summaries")  # an adapter nobody lists is a model like any other
    assert old.may_use("summaries") and not old.may_use("sales-bot")  # allowed_models as before
    limiter = TenantLimiter()
    refused = admit(limiter, open_, model="sales-bot")
    assert refused.reason is RefusalReason.MODEL_NOT_ALLOWED and refused.status_code == 403


def test_unlimited_tenant_charges_are_harmless() -> None:
    limiter, tenant = TenantLimiter(), make_tenant()
    for _ in range(1000):
        assert admit(limiter, tenant, input_tokens=10**6).ok
    limiter.charge("acme", 10**9, now=0.0)
    limiter.charge("nobody", 5, now=0.0)
    limiter.release("nobody")
    assert limiter.in_flight("acme") == 1000
