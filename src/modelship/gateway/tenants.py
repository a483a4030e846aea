"""Tenants: who a request belongs to (API key -> tenant) and what that tenant may spend.

Keys are configured and compared as sha256 hex digests: the gateway never holds, logs or
returns a key. Limits are token buckets over a minute (requests, and tokens counting
input and output) plus a cap on concurrent requests. Where they are kept is
`tenant_state.py`'s: in this process (N gateways admit up to N times each budget), or in
a store every gateway replica shares (`gateway.state`). This module decides what a request
asks for and how a refusal reads, the same for both.

Tokens per minute are reserved at admission: the input (an estimate from the prompt's
UTF-8 bytes, which errs high, or the exact count of token ids) plus what the output may
reach, `n x max_tokens` (the request's, else the tenant's `max_output_tokens`). A request
whose reservation does not fit waits (429 with Retry-After); one that could never fit is a
400. When it finishes the unused part is refunded from the replica's count. Only a
request with no output bound at all (neither) is charged its output after the fact, which
may take the bucket into debt; the tenant's next request then waits for it to refill.

`max_input_tokens` is checked here only on an exact count (token-id prompts): a text's
count is known only to the replica's tokenizer, so the gateway sends the cap along
(`replica_headers.MAX_INPUT_TOKENS_HEADER`) and the replica refuses with the same 400.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class Priority(IntEnum):
    """Request priority; the values are the engine's (higher runs first)."""

    LOW = -1
    NORMAL = 0
    HIGH = 1


def hash_api_key(key: str) -> str:
    """The sha256 hex digest under which a key is configured."""
    return hashlib.sha256(key.encode()).hexdigest()


def find_digest(key: str, digests: Sequence[str]) -> int | None:
    """The index of `key`'s digest among `digests`, or None. Every digest is compared in
    constant time and the loop never stops early, so timing says nothing about the keys."""
    digest = hash_api_key(key).encode()
    found = None
    for i, candidate in enumerate(digests):
        if hmac.compare_digest(digest, candidate.encode()):
            found = i
    return found


class TenantConfig(BaseModel):
    """One tenant. A limit left at None is no limit."""

    # Errors never echo input: a key pasted where its digest belongs must not reach logs.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    name: str = Field(min_length=1)
    # One or more keys (several allow rotation without downtime).
    api_key_sha256: list[str] = Field(min_length=1)
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)  # input + output
    max_concurrent: int | None = Field(default=None, ge=1)
    max_input_tokens: int | None = Field(default=None, ge=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    allowed_models: list[str] | None = None  # None: every served model
    # LoRA adapters (served model names) this tenant may use. An adapter any tenant lists
    # is private to the tenants that list it: no other key reaches it (403) or sees it in
    # /v1/models, whatever its allowed_models say. Adapters nobody lists are models like
    # any other (allowed_models decides).
    allowed_adapters: list[str] = Field(default_factory=list)
    priority: Literal["high", "normal", "low"] = "normal"
    # Tenants naming the same namespace share prefix-cache blocks on the replicas (a hit
    # makes one tenant's request faster when another sent the same prefix, so each can
    # time the other's prompts). None: a namespace of the tenant's own.
    cache_namespace: str | None = Field(default=None, min_length=1)
    # Precision tiers (`gateway.tiers`): false keeps every request of this tenant on the
    # primary tier (the production release's variant), however loaded; `min_variant` lets
    # it go down to the tier serving that variant, no further.
    allow_degraded: bool = True
    min_variant: str | None = Field(default=None, min_length=1)
    # Tiers this tenant's clients may name (`x-modelship-tier`) even when dearer than the
    # one its tier rules and brown-out give it; any client may name a cheaper one.
    may_request_tiers: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _digest_not_key(cls, data: object) -> object:
        """A tenant written with `api_key:` (or no key) gets how to make the digest, as one
        error instead of "Field required" beside "Extra inputs"."""
        if isinstance(data, dict) and "api_key_sha256" not in data:
            what = (
                "api_key: a tenant takes its key's sha256"
                if "api_key" in data
                else ("api_key_sha256 is required: a tenant takes its key's sha256")
            )
            raise ValueError(
                f"{what}, never the key (pipeline.yaml is read by many): write "
                "api_key_sha256: <the output of `printf %s \"$KEY\" | sha256sum | cut -d' ' -f1`>"
            )
        return data

    @field_validator("api_key_sha256", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("api_key_sha256")
    @classmethod
    def _hex_digests(cls, digests: list[str]) -> list[str]:
        for digest in digests:
            if not _SHA256_HEX.match(digest):
                # Never echo the value: it might be a pasted key instead of its hash.
                raise ValueError(
                    "api_key_sha256 takes lowercase sha256 hex digests (64 characters), "
                    "e.g. from `printf %s KEY | sha256sum`"
                )
        return digests

    @property
    def priority_level(self) -> Priority:
        return Priority[self.priority.upper()]


@dataclass(frozen=True)
class Tenant:
    name: str
    config: TenantConfig
    # Every tenant's `allowed_adapters`: the adapters only the tenants listing them may use.
    private_adapters: frozenset[str] = frozenset()

    @property
    def priority(self) -> Priority:
        return self.config.priority_level

    def may_use(self, model: str | None) -> bool:
        """Whether this tenant may ask for `model` (a base model or a LoRA adapter)."""
        config = self.config
        if model is not None and model in self.private_adapters:
            return model in config.allowed_adapters
        allowed = config.allowed_models
        return allowed is None or model in allowed or model in config.allowed_adapters

    @property
    def cache_salt(self) -> str:
        """The replicas' prefix-cache namespace for this tenant's requests: a digest, so
        replicas never see tenant names, and a shared namespace never equals a tenant's."""
        namespace = self.config.cache_namespace
        name = f"shared:{namespace}" if namespace is not None else f"tenant:{self.name}"
        return hashlib.sha256(name.encode()).hexdigest()


class TenantRegistry:
    """The configured tenants; checks names and key digests are unique."""

    def __init__(self, configs: Iterable[TenantConfig]) -> None:
        self._tenants: dict[str, Tenant] = {}
        self._digests: list[str] = []
        self._owners: list[Tenant] = []  # the tenant of each digest
        configs = list(configs)
        private = frozenset(name for config in configs for name in config.allowed_adapters)
        for config in configs:
            if config.name in self._tenants:
                raise ValueError(f"tenant {config.name!r} is configured twice")
            tenant = Tenant(config.name, config, private)
            self._tenants[config.name] = tenant
            for digest in config.api_key_sha256:
                if digest in self._digests:  # configuration, not a secret
                    raise ValueError(f"tenant {config.name!r} reuses another tenant's key")
                self._digests.append(digest)
                self._owners.append(tenant)

    def __len__(self) -> int:
        return len(self._tenants)

    def get(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def authenticate(self, api_key: str) -> Tenant | None:
        """The tenant owning `api_key`, or None (`find_digest`: constant time)."""
        found = find_digest(api_key, self._digests)
        return None if found is None else self._owners[found]


@dataclass(frozen=True)
class TakeResult:
    ok: bool
    retry_after_s: float  # 0 when ok; inf when the amount can never fit


class TokenBucket:
    """Holds up to `capacity` tokens, refilled at `refill_per_s`; starts full.

    `debit` may take the level below zero (charging work already done); takes wait until
    the debt is repaid.
    """

    def __init__(self, capacity: float, refill_per_s: float, now: float) -> None:
        if capacity <= 0 or refill_per_s <= 0:
            raise ValueError("capacity and refill_per_s must be positive")
        self.capacity = capacity
        self.refill_per_s = refill_per_s
        self._level = float(capacity)
        self._updated_at = now

    @classmethod
    def per_minute(cls, limit: int, now: float) -> TokenBucket:
        """`limit` per minute, with at most one minute's worth in a burst."""
        return cls(capacity=limit, refill_per_s=limit / 60.0, now=now)

    def level(self, now: float) -> float:
        self._refill(now)
        return self._level

    def retry_after_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` can be taken (0: now); changes nothing."""
        if amount > self.capacity:
            return math.inf
        missing = amount - self.level(now)
        return max(0.0, missing / self.refill_per_s)

    def try_take(self, amount: float, now: float) -> TakeResult:
        wait = self.retry_after_s(amount, now)
        if wait > 0:
            return TakeResult(False, wait)
        self._level -= amount
        return TakeResult(True, 0.0)

    def debit(self, amount: float, now: float) -> None:
        """Take `amount` even past zero (work already done); a negative amount refunds,
        up to `capacity`."""
        self._refill(now)
        self._level = min(self.capacity, self._level - amount)

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self._updated_at)  # a clock running backwards adds nothing
        self._level = min(self.capacity, self._level + elapsed * self.refill_per_s)
        self._updated_at = max(self._updated_at, now)


class RefusalReason(StrEnum):
    """Why a tenant's request was refused; a fixed set, usable as a metric label."""

    MODEL_NOT_ALLOWED = "model_not_allowed"
    INPUT_TOO_LONG = "input_too_long"
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    MAX_CONCURRENT = "max_concurrent"
    REQUESTS_PER_MINUTE = "requests_per_minute"
    TOKENS_PER_MINUTE = "tokens_per_minute"
    # The shared store of tenant state (`gateway.state`) did not answer and
    # `gateway.state_failure` is closed: a 503, nobody's fault.
    STATE_UNAVAILABLE = "state_unavailable"


@dataclass(frozen=True)
class LimitDecision:
    """The limiter's answer. When admitted, `max_tokens` is the output cap to send on
    (the tenant's cap when the request named none). When refused, `status_code` is the
    HTTP status (403, 400 or 429) and `retry_after_s` is set for the 429s."""

    ok: bool
    reason: RefusalReason | None = None
    status_code: int = 200
    retry_after_s: float | None = None
    max_tokens: int | None = None
    message: str = ""
    param: str | None = None  # the field at fault
    # Taken from the tokens-per-minute bucket: the input plus the output's bound.
    num_reserved_tokens: int = 0
    # What the store of tenant state knows this admission by ("" where it holds nothing for
    # it); given back to `TenantState.settle`.
    hold_id: str = ""


@dataclass
class _TenantUsage:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0


@dataclass(frozen=True)
class Ask:
    """What an admissible request takes from its tenant's quotas."""

    num_sequences: int  # concurrency slots
    num_tokens: int  # the tokens-per-minute reservation: the input plus `num_output`
    num_output: int  # n x the output cap (0: no output bound)
    max_tokens: int | None  # the output cap to send on


def plan_admission(
    tenant: Tenant,
    model: str,
    input_tokens: int,
    max_tokens: int | None,
    num_sequences: int = 1,
    check_max_input: bool = True,
) -> LimitDecision | Ask:
    """The refusal no waiting can fix, else what the request would take (`Ask`). Pure: the
    same for every store of tenant state (`tenant_state.py`)."""
    config = tenant.config
    refused = _check_request(
        tenant, model, input_tokens if check_max_input else None, max_tokens, num_sequences
    )
    if refused is not None:
        return refused
    cap = max_tokens if max_tokens is not None else config.max_output_tokens
    num_output = num_sequences * cap if cap is not None else 0
    return Ask(num_sequences, input_tokens + num_output, num_output, cap)


def quota_refusal(
    config: TenantConfig, reason: RefusalReason, retry_after_s: float, ask: Ask
) -> LimitDecision:
    """The refusal for a quota that is full now (429), or that `ask` could never fit in
    (`retry_after_s` inf: 400)."""
    if reason is RefusalReason.MAX_CONCURRENT:
        message = f"at most {config.max_concurrent} concurrent requests"
    elif reason is RefusalReason.REQUESTS_PER_MINUTE:
        message = f"at most {config.requests_per_minute} requests per minute"
    else:
        if math.isinf(retry_after_s):
            return _never_fits(config, ask.num_tokens - ask.num_output, ask.num_output)
        message = f"at most {config.tokens_per_minute} tokens per minute"
    return _too_many(reason, retry_after_s, message)


class TenantLimiter:
    """Admits or refuses each tenant's requests against its limits, in this process.

    Check, then commit: nothing is taken from any bucket unless every check passes. An
    admitted request holds one concurrency slot per sequence (`n` per prompt) until
    `release`; its output tokens are charged with `charge` (as they stream, or once at the
    end).
    """

    def __init__(self, concurrency_retry_after_s: float = 1.0) -> None:
        self.concurrency_retry_after_s = concurrency_retry_after_s
        self._usage: dict[str, _TenantUsage] = {}  # one per configured tenant, no more

    def in_flight(self, tenant_name: str) -> int:
        usage = self._usage.get(tenant_name)
        return usage.in_flight if usage else 0

    def admit(
        self,
        tenant: Tenant,
        model: str,
        input_tokens: int,
        max_tokens: int | None,
        now: float,
        num_sequences: int = 1,
        check_max_input: bool = True,
    ) -> LimitDecision:
        """`check_max_input` False: `input_tokens` is an estimate and the replica checks
        `max_input_tokens` on the real count."""
        ask = plan_admission(tenant, model, input_tokens, max_tokens, num_sequences,
                             check_max_input)  # fmt: skip
        if isinstance(ask, LimitDecision):
            return ask
        config = tenant.config
        usage = self._usage_of(tenant, now)
        if (
            config.max_concurrent is not None
            and usage.in_flight + num_sequences > config.max_concurrent
        ):
            reason = RefusalReason.MAX_CONCURRENT
            return quota_refusal(config, reason, self.concurrency_retry_after_s, ask)
        if usage.requests is not None:
            wait = usage.requests.retry_after_s(1, now)
            if wait > 0:
                return quota_refusal(config, RefusalReason.REQUESTS_PER_MINUTE, wait, ask)
        if usage.tokens is not None:
            wait = usage.tokens.retry_after_s(ask.num_tokens, now)
            if wait > 0:
                return quota_refusal(config, RefusalReason.TOKENS_PER_MINUTE, wait, ask)
        # Commit: every check passed.
        if usage.requests is not None:
            usage.requests.try_take(1, now)
        if usage.tokens is not None:
            usage.tokens.try_take(ask.num_tokens, now)
        usage.in_flight += num_sequences
        return LimitDecision(ok=True, max_tokens=ask.max_tokens, num_reserved_tokens=ask.num_tokens)

    def charge(self, tenant_name: str, num_tokens: int, now: float) -> None:
        """Debit tokens used past the reservation (may leave the tenant in debt); a
        negative count refunds the part of the reservation a request did not use."""
        usage = self._usage.get(tenant_name)
        if usage is not None and usage.tokens is not None and num_tokens != 0:
            usage.tokens.debit(num_tokens, now)

    def release(self, tenant_name: str, num_sequences: int = 1) -> None:
        """Free the concurrency slots of an admitted request, however it ended."""
        usage = self._usage.get(tenant_name)
        if usage is not None:
            usage.in_flight = max(0, usage.in_flight - num_sequences)

    def _usage_of(self, tenant: Tenant, now: float) -> _TenantUsage:
        usage = self._usage.get(tenant.name)
        if usage is None:
            config = tenant.config
            usage = _TenantUsage(
                requests=_per_minute(config.requests_per_minute, now),
                tokens=_per_minute(config.tokens_per_minute, now),
            )
            self._usage[tenant.name] = usage
        return usage


def _check_request(
    tenant: Tenant,
    model: str,
    input_tokens: int | None,
    max_tokens: int | None,
    num_sequences: int,
) -> LimitDecision | None:
    """The limits that no waiting can fix (`input_tokens` None: left to the replica)."""
    config = tenant.config
    if config.max_concurrent is not None and num_sequences > config.max_concurrent:
        return LimitDecision(
            ok=False,
            reason=RefusalReason.MAX_CONCURRENT,
            status_code=400,
            message=f"the request asks for {num_sequences} sequences at once; "
            f"this key allows at most {config.max_concurrent} concurrent",
        )
    if not tenant.may_use(model):
        return LimitDecision(
            ok=False,
            reason=RefusalReason.MODEL_NOT_ALLOWED,
            status_code=403,
            message=f"this key may not use model {model!r}",
        )
    if (
        config.max_input_tokens is not None
        and input_tokens is not None
        and input_tokens > config.max_input_tokens
    ):
        return LimitDecision(
            ok=False,
            reason=RefusalReason.INPUT_TOO_LONG,
            status_code=400,
            message=f"the prompt has {input_tokens} tokens; "
            f"this key allows at most {config.max_input_tokens}",
        )
    cap = config.max_output_tokens
    if cap is not None and max_tokens is not None and max_tokens > cap:
        return LimitDecision(
            ok=False,
            reason=RefusalReason.MAX_TOKENS_TOO_LARGE,
            status_code=400,
            message=f"max_tokens is {max_tokens}; this key allows at most {cap}",
        )
    return None


def _per_minute(limit: int | None, now: float) -> TokenBucket | None:
    return None if limit is None else TokenBucket.per_minute(limit, now)


def _never_fits(config: TenantConfig, input_tokens: int, num_output: int) -> LimitDecision:
    """The 400 for a reservation over the whole quota: waiting would never help."""
    quota = f"the quota of {config.tokens_per_minute} tokens per minute"
    if input_tokens > (config.tokens_per_minute or 0):
        message, param = f"the prompt's {input_tokens} tokens exceed {quota}", None
    else:
        message = (f"the prompt's {input_tokens} tokens and up to {num_output} output tokens "
                   f"(n x max_tokens) exceed {quota}; lower max_tokens")  # fmt: skip
        param = "max_tokens"
    return LimitDecision(ok=False, reason=RefusalReason.TOKENS_PER_MINUTE, status_code=400,
                         message=message, param=param)  # fmt: skip


def _too_many(reason: RefusalReason, retry_after_s: float, message: str) -> LimitDecision:
    return LimitDecision(
        ok=False, reason=reason, status_code=429, retry_after_s=retry_after_s, message=message
    )
