"""Who may call the gateway, by API key: tenants (the OpenAI API), the metrics scraper
(`/metrics`'s per-request series) and the operator (`/v1/load_lora_adapter`).

Every key is compared as its sha256 digest, against every configured digest, in constant
time and with no early exit (`tenants.find_digest`): how long a refusal takes says nothing
about the keys.
"""

from __future__ import annotations

from starlette.requests import Request

from modelship.gateway.config import GatewayConfig
from modelship.gateway.request import GatewayError, unauthorized
from modelship.gateway.tenants import (
    Tenant,
    TenantConfig,
    TenantRegistry,
    find_digest,
    hash_api_key,
)

_ANONYMOUS = Tenant("anonymous", TenantConfig(name="anonymous", api_key_sha256=["0" * 64]))


def build_registry(config: GatewayConfig, api_key: str | None) -> TenantRegistry | None:
    """The configured tenants; else one tenant for `api_key`; else None (open access)."""
    if config.tenants:
        return TenantRegistry(config.tenants)
    if api_key:
        return TenantRegistry([TenantConfig(name="default", api_key_sha256=hash_api_key(api_key))])
    return None


def bearer_key(request: Request) -> str:
    """The request's `Authorization: Bearer` key; "" when it has none."""
    header = request.headers.get("authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else ""


class GatewayAuth:
    """The gateway's three kinds of key. Refusals are `GatewayError`s (401, 403, 404)."""

    def __init__(self, config: GatewayConfig, api_key: str | None) -> None:
        self.registry = build_registry(config, api_key)
        self.has_tenants = bool(config.tenants)
        self.metrics_digests = list(config.metrics_api_key_sha256)
        self.admin_digests = list(config.admin_api_key_sha256)
        # Tenants whose key is also a metrics or admin key: the operator's own.
        operator_keys = {*self.metrics_digests, *self.admin_digests}
        self.release_readers = {
            t.name for t in config.tenants if operator_keys.intersection(t.api_key_sha256)
        }

    def authenticate(self, request: Request) -> Tenant:
        """The tenant the request's key belongs to (anyone's on a gateway without keys)."""
        if self.registry is None:
            return _ANONYMOUS
        key = bearer_key(request)
        tenant = self.registry.authenticate(key) if key else None
        if tenant is None:
            raise unauthorized()
        return tenant

    def can_read_request_metrics(self, request: Request) -> bool:
        """Whether the scrape gets the series that move per request (`metrics.py`): True
        for a metrics key, and without a key only on a gateway without API keys (anyone
        may send it requests anyway); without a key otherwise, False (the fleet's series
        alone). Any other key is refused (401), so a misconfigured scraper hears of it."""
        key = bearer_key(request)
        if not key:
            return self.registry is None
        if find_digest(key, self.metrics_digests) is None:
            raise unauthorized()
        return True

    def authenticate_admin(self, request: Request) -> None:
        """An admin key (`admin_api_key_sha256`); 404 when none is configured, 403 for a
        tenant's key, 401 for anything else."""
        if not self.admin_digests:
            raise GatewayError(404, "changing LoRA adapters through the gateway is off (set "
                               "gateway.admin_api_key_sha256)", code="not_found")  # fmt: skip
        key = bearer_key(request)
        if find_digest(key, self.admin_digests) is not None:
            return
        if key and self.registry is not None and self.registry.authenticate(key) is not None:
            raise GatewayError(403, "this key may not change the served adapters",
                               "permission_error", "forbidden")  # fmt: skip
        raise unauthorized()

    def says_release(self, tenant: Tenant) -> bool:
        """Whether `x-modelship-release` goes to this tenant: on a gateway without tenants
        (the operator's), else only to a tenant whose key is also a metrics or admin key.
        Any other tenant told its track could look for a canary session and aim traffic
        at it."""
        return not self.has_tenants or tenant.name in self.release_readers
