"""Where tenants' quotas are kept: requests per minute, tokens per minute (the reservations
and their refunds) and concurrency slots.

`TenantState` is the interface the request path uses. `LocalTenantState` keeps them in
this gateway process (`TenantLimiter`), as without `gateway.state`: each gateway replica
admits a whole budget of its own. `RedisTenantState` (`redis_state.py`) keeps them in a
Redis-protocol store every gateway replica shares (`gateway.state: redis://...`), so a
tenant's budget holds across replicas. `create_tenant_state` picks one from the config.

What a request asks for, and how a refusal reads, is `tenants.plan_admission`'s and
`tenants.quota_refusal`'s, the same for both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from modelship.gateway.config import GatewayConfig
from modelship.gateway.metrics import GatewayMetrics
from modelship.gateway.tenants import LimitDecision, Tenant, TenantLimiter


class TenantState(Protocol):
    """The quotas of every tenant, checked and taken atomically.

    `admit` refuses (a `LimitDecision` not ok) or takes one request, one concurrency slot
    per sequence and the request's token reservation, all or nothing. Every admitted
    request is settled exactly once with `settle`, however it ended: its slots go back and
    `num_tokens` is charged (negative: the unused part of the reservation refunded).
    `settle` returns at once; a shared store applies it shortly after (`close` waits for
    those still on their way).
    """

    async def admit(
        self,
        tenant: Tenant,
        model: str,
        input_tokens: int,
        max_tokens: int | None,
        num_sequences: int = 1,
        check_max_input: bool = True,
    ) -> LimitDecision: ...

    def settle(
        self, tenant: Tenant, decision: LimitDecision, num_tokens: int, num_sequences: int
    ) -> None: ...

    async def close(self) -> None: ...


class LocalTenantState:
    """Quotas in this process: `TenantLimiter` on the monotonic clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.limiter = TenantLimiter()
        self.clock = clock

    async def admit(
        self,
        tenant: Tenant,
        model: str,
        input_tokens: int,
        max_tokens: int | None,
        num_sequences: int = 1,
        check_max_input: bool = True,
    ) -> LimitDecision:
        return self.limiter.admit(tenant, model, input_tokens, max_tokens, self.clock(),
                                  num_sequences, check_max_input)  # fmt: skip

    def settle(
        self, tenant: Tenant, decision: LimitDecision, num_tokens: int, num_sequences: int
    ) -> None:
        self.limiter.charge(tenant.name, num_tokens, self.clock())
        self.limiter.release(tenant.name, num_sequences)

    async def close(self) -> None:
        return None


def create_tenant_state(config: GatewayConfig, metrics: GatewayMetrics) -> TenantState:
    """`RedisTenantState` where `gateway.state` names a store, else `LocalTenantState`."""
    if config.state is None:
        return LocalTenantState()
    from modelship.gateway.redis_state import RedisTenantState  # the client only if used

    return RedisTenantState(
        config.state,
        fail_open=config.state_failure == "open",
        failures=metrics.state_failures,
        # A slot a gateway never gave back (it died) frees itself after the longest a
        # request can be held.
        slot_lease_s=config.resilience.request_timeout_s + 60.0,
    )
