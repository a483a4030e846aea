"""What the gateway does differently per engine behind an endpoint: ours or vLLM.

The two speak the same OpenAI API but differ where the gateway reaches past it:

- health: `modelship serve` answers `GET /ready` (503 while starting or draining); vLLM
  has no /ready, and its `GET /health` is 200 once the model is loaded.
- priority: the request's `priority` field. Ours runs higher values first (the tenant's
  class as is: -1, 0, 1); vLLM runs lower values first, and refuses any value but 0 with
  a 400 unless started with `--scheduling-policy priority` (the deploy render passes it).
- mid-stream failover: resuming a stream on another replica sends `resume_token_ids`,
  which only ours reads (vLLM would ignore it and generate the answer again from the
  start), so no stream is failed over to, or from, a pool holding a vLLM replica.
- the tenant's prefix-cache namespace: ours reads the cache-salt header (with the replica
  key), vLLM its own `cache_salt` body field, which the gateway sets (over a client's).

The kind is per endpoint: `modelship up` runs ours; `modelship gateway` is told with
`--engine` (the rendered manifests and the chart set it from `deploy.serving.engine`).
"""

from __future__ import annotations

from enum import StrEnum

from modelship.gateway.request import ParsedRequest
from modelship.gateway.tenants import Priority


class EngineKind(StrEnum):
    """The values are `deploy.serving.engine`'s."""

    MODELSHIP = "ours"
    VLLM = "vllm"

    @property
    def health_path(self) -> str:
        """200 there: the replica takes requests."""
        return "/health" if self is EngineKind.VLLM else "/ready"

    @property
    def can_resume(self) -> bool:
        """Continues a stream from `resume_token_ids` (mid-stream failover)."""
        return self is EngineKind.MODELSHIP

    def priority(self, priority: Priority) -> int:
        """The request's `priority` field for a tenant's class."""
        return -int(priority) if self is EngineKind.VLLM else int(priority)


class UpstreamBodies:
    """The body each engine kind is sent for one request, encoded once per kind (the
    client's bytes are not re-encoded: `ParsedRequest.encode` appends what changed)."""

    def __init__(self, parsed: ParsedRequest, priority: Priority, cache_salt: str) -> None:
        self.parsed = parsed
        self.priority = priority
        self.cache_salt = cache_salt
        self._bodies: dict[tuple[EngineKind, str | None], bytes] = {}

    def of(self, engine: EngineKind, model: str | None = None) -> bytes:
        """The body for `engine`; `model`: the name it asks for, where a model tier sends
        the request to another model than its own (None: the client's)."""
        body = self._bodies.get((engine, model))
        if body is None:
            extra: dict[str, object] = {"priority": engine.priority(self.priority)}
            if engine is EngineKind.VLLM:
                extra["cache_salt"] = self.cache_salt
            if model is not None:
                extra["model"] = model
            body = self.parsed.encode(**extra)
            self._bodies[(engine, model)] = body
        return body
