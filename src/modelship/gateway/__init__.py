"""The gateway's policy core: routing, resilience, tenants and admission.

Everything here is synchronous, deterministic and free of I/O, so the async gateway
process calls it between awaits and tests drive it with stub endpoints and fake clocks.
Time comes in as `now` (token buckets, limiter) or an injected `clock` (breaker,
outlier detector).
"""

from modelship.gateway.admission import AdmissionConfig, AdmissionDecision, AdmissionQueue
from modelship.gateway.endpoint import (
    Decision,
    Endpoint,
    NoEndpointError,
    OutputLengthEstimator,
    Reason,
    RoutingRequest,
    chat_prefix_text,
    estimate_num_tokens,
)
from modelship.gateway.resilience import (
    BreakerState,
    CircuitBreaker,
    Failure,
    FailureKind,
    OutlierDetector,
    RetryPolicy,
)
from modelship.gateway.routing import Router, create_router, supported_routers
from modelship.gateway.tenants import (
    LimitDecision,
    Priority,
    RefusalReason,
    Tenant,
    TenantConfig,
    TenantLimiter,
    TenantRegistry,
    TokenBucket,
    hash_api_key,
)

__all__ = [
    "AdmissionConfig",
    "AdmissionDecision",
    "AdmissionQueue",
    "BreakerState",
    "CircuitBreaker",
    "Decision",
    "Endpoint",
    "Failure",
    "FailureKind",
    "LimitDecision",
    "NoEndpointError",
    "OutlierDetector",
    "OutputLengthEstimator",
    "Priority",
    "Reason",
    "RefusalReason",
    "RetryPolicy",
    "Router",
    "RoutingRequest",
    "Tenant",
    "TenantConfig",
    "TenantLimiter",
    "TenantRegistry",
    "TokenBucket",
    "chat_prefix_text",
    "create_router",
    "estimate_num_tokens",
    "hash_api_key",
    "supported_routers",
]
