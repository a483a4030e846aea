"""Tenants' quotas in a Redis-protocol store shared by every gateway replica
(`gateway.state: redis://HOST:PORT/DB`, Redis >= 5 or Valkey).

Each admission is one Lua script, so its checks and takes are atomic across replicas, on
the store's clock (`TIME`: replicas' clocks need not agree). Per tenant, these keys, in
one hash slot (`{tenant}`, for Redis Cluster):
- `modelship:{T}:requests` and `modelship:{T}:tokens`: token buckets, a hash of `level`
  and `at` (seconds), refilled at limit/60 per second up to the limit, as
  `tenants.TokenBucket`; each expires once it would be full again, saying nothing then
  that a missing key does not.
- `modelship:{T}:slots`: concurrency slots, a sorted set of `HOLD:i` (one per sequence)
  scored by when the slot expires: `slot_lease_s` after admission, so a gateway that
  died holding slots gives them back after at most the longest a request can be held.
- `modelship:{T}:hold:HOLD`: one per admitted request until it is settled (same lease).
Settling (the refund or charge, and the slots back) is a second script, run in a task
started when the response ends: a slot is free again once it lands, a loop turn later. It
applies only while the hold's key exists and deletes it, so a settle is applied once
however often it is sent: one that failed (or timed out, having perhaps run) is sent again,
`settle_retry_delays_s` apart, before the slots are left to their lease.

The store not answering (connection refused or lost, `socket_timeout_s` passed): with
`gateway.state_failure: closed` (the default) the request is refused, 503 with
Retry-After, code `state_unavailable`; with `open` it is admitted unmetered (the checks
that need no state still apply). Either way `modelship_gateway_state_failures_total`
counts it and a warning is logged (the first failure, then at most one line per
`log_every_s`). A settle that fails every time leaves the slots to their lease and the
reservation charged in full. An admission is never retried: one that timed out may have
run, and running it again would take twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from prometheus_client import Counter
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from modelship.gateway.tenants import (
    Ask,
    LimitDecision,
    RefusalReason,
    Tenant,
    plan_admission,
    quota_refusal,
)

logger = logging.getLogger(__name__)

# The store's time, and the buckets as `tenants.TokenBucket` keeps them.
_BUCKETS = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local function level(key, per_minute)
  local saved = redis.call('HMGET', key, 'level', 'at')
  if not saved[1] then return per_minute end
  local elapsed = math.max(0, now - tonumber(saved[2]))
  return math.min(per_minute, tonumber(saved[1]) + elapsed * per_minute / 60)
end
local function save(key, per_minute, new_level)
  redis.call('HSET', key, 'level', tostring(new_level), 'at', tostring(now))
  local full_in_s = (per_minute - new_level) * 60 / per_minute
  redis.call('PEXPIRE', key, math.ceil(full_in_s * 1000) + 1000)
end
"""

# KEYS: slots, requests, tokens, hold. ARGV: max_concurrent, requests/min, tokens/min (0: no
# limit), sequences, tokens to reserve, hold id, slot lease (s).
# Returns {outcome, seconds to wait}: 0 admitted, 1 concurrency, 2 requests/min,
# 3 tokens/min, 4 tokens/min never (more than the whole quota).
_ADMIT = (
    _BUCKETS
    + """
local max_concurrent, rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local n, num_tokens, hold, lease = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
if max_concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) + n > max_concurrent then return {1, '0'} end
end
local requests, tokens
if rpm > 0 then
  requests = level(KEYS[2], rpm)
  if requests < 1 then return {2, tostring((1 - requests) * 60 / rpm)} end
end
if tpm > 0 then
  if num_tokens > tpm then return {4, '0'} end
  tokens = level(KEYS[3], tpm)
  if tokens < num_tokens then return {3, tostring((num_tokens - tokens) * 60 / tpm)} end
end
if rpm > 0 then save(KEYS[2], rpm, requests - 1) end
if tpm > 0 then save(KEYS[3], tpm, tokens - num_tokens) end
if max_concurrent > 0 then
  for i = 1, n do redis.call('ZADD', KEYS[1], now + lease, hold .. ':' .. i) end
  redis.call('PEXPIRE', KEYS[1], math.ceil(lease * 1000) + 1000)
end
redis.call('SET', KEYS[4], n, 'PX', math.ceil(lease * 1000))
return {0, '0'}
"""
)

# KEYS: slots, tokens, hold. ARGV: tokens/min (0: no limit), tokens to charge (negative:
# refund), hold id, sequences. Returns 1 where applied, 0 where already settled (or lost).
_SETTLE = (
    _BUCKETS
    + """
local tpm, num_tokens, hold, n = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
if redis.call('DEL', KEYS[3]) == 0 then return 0 end
for i = 1, n do redis.call('ZREM', KEYS[1], hold .. ':' .. i) end
if tpm > 0 and num_tokens ~= 0 then
  save(KEYS[2], tpm, math.min(tpm, level(KEYS[2], tpm) - num_tokens))
end
return 1
"""
)

_REFUSALS = {
    1: RefusalReason.MAX_CONCURRENT,
    2: RefusalReason.REQUESTS_PER_MINUTE,
    3: RefusalReason.TOKENS_PER_MINUTE,
    4: RefusalReason.TOKENS_PER_MINUTE,
}


def _keys(tenant_name: str, hold_id: str) -> tuple[str, str, str, str]:
    """The tenant's slots, requests, tokens and hold keys (one Redis Cluster hash slot)."""
    tag = f"modelship:{{{tenant_name}}}"
    return f"{tag}:slots", f"{tag}:requests", f"{tag}:tokens", f"{tag}:hold:{hold_id}"


class RedisTenantState:
    """`tenant_state.TenantState` in a Redis-protocol store (the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        fail_open: bool,
        failures: Counter,
        slot_lease_s: float,
        concurrency_retry_after_s: float = 1.0,
        socket_timeout_s: float = 0.5,
        log_every_s: float = 10.0,
        settle_retry_delays_s: tuple[float, ...] = (0.2, 0.5, 1.0, 2.0, 4.0, 8.0),
    ) -> None:
        self.fail_open = fail_open
        self.failures = failures  # labelled by operation: admit, settle
        self.slot_lease_s = slot_lease_s
        self.concurrency_retry_after_s = concurrency_retry_after_s
        self.log_every_s = log_every_s
        self.settle_retry_delays_s = settle_retry_delays_s
        self._redis = Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._admit_script = self._redis.register_script(_ADMIT)
        self._settle_script = self._redis.register_script(_SETTLE)
        self._pending: set[asyncio.Task] = set()
        self._is_failing = False
        self._logged_at = -float("inf")

    async def admit(
        self,
        tenant: Tenant,
        model: str,
        input_tokens: int,
        max_tokens: int | None,
        num_sequences: int = 1,
        check_max_input: bool = True,
    ) -> LimitDecision:
        ask = plan_admission(tenant, model, input_tokens, max_tokens, num_sequences,
                             check_max_input)  # fmt: skip
        if isinstance(ask, LimitDecision):
            return ask
        config = tenant.config
        limits = (config.max_concurrent, config.requests_per_minute, config.tokens_per_minute)
        if all(limit is None for limit in limits):
            return _admitted(ask, hold_id="")  # nothing to keep for this tenant
        hold_id = uuid.uuid4().hex
        args = [*(limit or 0 for limit in limits), num_sequences, ask.num_tokens, hold_id,
                self.slot_lease_s]  # fmt: skip
        try:
            outcome, wait = await self._admit_script(keys=_keys(tenant.name, hold_id), args=args)
        except (RedisError, OSError) as error:
            self._failed("admit", error)
            if self.fail_open:
                return _admitted(ask, hold_id="")  # unmetered: nothing to settle
            return LimitDecision(
                ok=False,
                reason=RefusalReason.STATE_UNAVAILABLE,
                status_code=503,
                retry_after_s=1.0,
                message="the tenant quota store (gateway.state) does not answer; retry shortly",
            )
        self._answered()
        if outcome == 0:
            return _admitted(ask, hold_id)
        reason = _REFUSALS[int(outcome)]
        if outcome == 1:
            retry_after_s = self.concurrency_retry_after_s
        else:
            retry_after_s = float("inf") if outcome == 4 else float(wait)
        return quota_refusal(config, reason, retry_after_s, ask)

    def settle(
        self, tenant: Tenant, decision: LimitDecision, num_tokens: int, num_sequences: int
    ) -> None:
        if not decision.hold_id:
            return
        task = asyncio.get_running_loop().create_task(
            self._settle_now(tenant, decision.hold_id, num_tokens, num_sequences)
        )
        self._pending.add(task)  # held, so the task is not collected before it ran
        task.add_done_callback(self._pending.discard)

    async def settled(self, timeout_s: float = 20.0) -> None:
        """Wait (at most `timeout_s`) for the settles on their way to the store."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)

    async def close(self) -> None:
        await self.settled(timeout_s=2.0)  # a gateway shutting down waits no longer
        await self._redis.aclose()

    async def _settle_now(
        self, tenant: Tenant, hold_id: str, num_tokens: int, num_sequences: int
    ) -> None:
        slots, _, tokens, hold = _keys(tenant.name, hold_id)
        args = [tenant.config.tokens_per_minute or 0, num_tokens, hold_id, num_sequences]
        for delay_s in (*self.settle_retry_delays_s, None):
            try:
                await self._settle_script(keys=[slots, tokens, hold], args=args)
            except (RedisError, OSError) as error:
                self._failed("settle", error)
                if delay_s is None:
                    return  # the slots wait for their lease
                await asyncio.sleep(delay_s)
            else:
                self._answered()
                return

    def _failed(self, operation: str, error: BaseException) -> None:
        self.failures.labels(operation).inc()
        now = time.monotonic()
        if not self._is_failing or now - self._logged_at >= self.log_every_s:
            mode = "admitted unmetered" if self.fail_open else "refused (503)"
            logger.warning(
                "gateway.state: the tenant quota store did not answer (%s: %s); requests "
                "are %s while it does not (gateway.state_failure)",
                type(error).__name__, error, mode,
            )  # fmt: skip
            self._logged_at = now
        self._is_failing = True

    def _answered(self) -> None:
        if self._is_failing:
            logger.warning("gateway.state: the tenant quota store answers again")
            self._is_failing = False


def _admitted(ask: Ask, hold_id: str) -> LimitDecision:
    return LimitDecision(
        ok=True, max_tokens=ask.max_tokens, num_reserved_tokens=ask.num_tokens, hold_id=hold_id
    )
