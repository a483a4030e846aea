"""What the gateway replicas share, beyond the tenants' quotas, so that they decide alike
(`gateway.state: redis://...`; without it each gateway decides from what it sees alone):

- The canary split's secret. The split hashes a request's session with it
  (`canary.in_canary`); with `gateway.canary.split_secret` unset, each process would draw
  its own, and a session's requests would land on either track depending on the gateway
  replica the load balancer picked. The first gateway to start stores a random secret
  (`SET NX`, never expiring: a changed secret would move sessions) and every gateway uses
  that one.
- The tiers' load for brown-out (`tiers.choose_tier`): the primary tier is overloaded at
  `brownout.max_in_flight_per_replica` requests in flight per replica, counting every
  gateway's requests, not only this one's (else N gateway replicas brown out at N times
  the configured load). Each gateway publishes its in-flight requests per tier every
  `interval_s` and reads the others' sum in the same script (atomic, on the store's
  clock); a gateway that stops publishing (it died) drops out after `ttl_s`.

The store not answering: the secret stays this process's own (logged), and the others'
load reads as none until it answers again: each gateway then browns out on its own load,
as without a store. Either way `modelship_gateway_state_failures_total` counts it
(operation `secret` or `load`) and a warning is logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections.abc import Callable

from prometheus_client import Counter
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

# One hash slot (`{gateways}`) for Redis Cluster: the script touches both keys.
LOADS_KEY = "modelship:{gateways}:loads"  # gateway id -> JSON {tier: in flight}
ALIVE_KEY = "modelship:{gateways}:alive"  # gateway id scored by when its entry expires
SECRET_KEY = "modelship:canary:split_secret"

# KEYS: loads, alive. ARGV: this gateway's id, its loads (JSON), ttl (s). Drops the entries
# of gateways that stopped publishing, saves this one's, returns every entry (id, JSON...).
_EXCHANGE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('HDEL', KEYS[1], gone)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return redis.call('HGETALL', KEYS[1])
"""


class SharedDecisions:
    """The split secret and the other gateways' load, in a Redis-protocol store (see the
    module doc). `local_load` gives this gateway's in-flight requests by tier."""

    def __init__(
        self,
        url: str,
        local_load: Callable[[], dict[str, int]],
        failures: Counter,
        *,
        interval_s: float = 0.25,
        ttl_s: float = 3.0,
        socket_timeout_s: float = 0.5,
    ) -> None:
        self.local_load = local_load
        self.failures = failures  # labelled by operation
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.gateway_id = uuid.uuid4().hex
        self.others: dict[str, int] = {}  # tier -> requests in flight at the other gateways
        self._redis = Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._exchange = self._redis.register_script(_EXCHANGE)
        self._task: asyncio.Task | None = None
        self._is_failing = False

    async def split_secret(self) -> str | None:
        """The secret every gateway's canary split uses, stored by the first to ask; None
        where the store does not answer (the caller keeps its own)."""
        try:
            await self._redis.set(SECRET_KEY, os.urandom(32).hex(), nx=True)
            secret = await self._redis.get(SECRET_KEY)
        except (RedisError, OSError) as error:
            self._failed("secret", error)
            return None
        return secret.decode() if isinstance(secret, bytes) else secret

    async def start(self) -> None:
        """The first exchange, then one every `interval_s` until `close`."""
        await self.exchange()
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._redis.aclose()

    async def exchange(self) -> None:
        """Publish this gateway's load; `others` becomes the sum of the other gateways'."""
        mine = json.dumps(self.local_load())
        try:
            entries = await self._exchange(keys=[LOADS_KEY, ALIVE_KEY],
                                           args=[self.gateway_id, mine, self.ttl_s])  # fmt: skip
        except (RedisError, OSError) as error:
            self._failed("load", error)
            self.others = {}
            return
        if self._is_failing:
            logger.warning("gateway.state: the store answers again; brown-out counts every "
                           "gateway's load")  # fmt: skip
            self._is_failing = False
        others: dict[str, int] = {}
        for gateway_id, loads in zip(entries[::2], entries[1::2], strict=True):
            if _text(gateway_id) == self.gateway_id:
                continue
            for tier, in_flight in json.loads(_text(loads)).items():
                others[tier] = others.get(tier, 0) + int(in_flight)
        self.others = others

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.exchange()

    def _failed(self, operation: str, error: BaseException) -> None:
        self.failures.labels(operation).inc()
        if not self._is_failing:
            logger.warning(
                "gateway.state: the store did not answer (%s: %s); this gateway's canary "
                "split and brown-out decide from what it sees alone while it does not",
                type(error).__name__, error,
            )  # fmt: skip
        self._is_failing = True


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
