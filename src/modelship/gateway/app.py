"""The gateway's HTTP app (Starlette): the OpenAI routes, health, readiness and metrics.

Routes only delegate to `GatewayService`. Background work the process needs (the
supervisor, release-plan polling) is passed in as `Lifecycle` hooks and runs inside the
app's lifespan, on the same event loop as the request path.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelship.body_limit import BodySizeLimit
from modelship.gateway.adapters import parse_body
from modelship.gateway.groups import model_group
from modelship.gateway.metrics import CONTENT_TYPE
from modelship.gateway.request import GatewayError, unavailable
from modelship.gateway.responses import respond
from modelship.gateway.service import GatewayService
from modelship.gateway.tenants import Tenant

Hook = Callable[[], Awaitable[None]]


def create_gateway_app(
    service: GatewayService,
    on_startup: list[Hook] | None = None,
    on_shutdown: list[Hook] | None = None,
    health_checks: bool = True,
) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette):
        await service.start(health_checks=health_checks)
        for hook in on_startup or []:
            await hook()
        try:
            yield
        finally:
            for hook in on_shutdown or []:
                await hook()
            await service.close()

    async def completions(request: Request) -> Response:
        return await service.handle(request)

    async def responses(request: Request) -> Response:
        return await respond(service, request)

    async def models(request: Request) -> Response:
        try:
            tenant = service.auth.authenticate(request)
            return await _models_from_replica(service, tenant)
        except GatewayError as error:
            return error.response()

    async def change_adapters(request: Request) -> Response:
        action = "load" if request.url.path.endswith("/load_lora_adapter") else "unload"
        try:
            service.auth.authenticate_admin(request)
            body = parse_body(await request.body(), action, service.config.adapter_roots)
            status, payload = await service.change_adapters(action, body)
        except GatewayError as error:
            return error.response()
        return JSONResponse(payload, status_code=status)

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def ready(_: Request) -> Response:
        if service.is_ready():
            return JSONResponse({"status": "ready"})
        status = "draining" if service.is_draining else "no replica ready"
        return JSONResponse({"status": status}, status_code=503)

    async def metrics(request: Request) -> Response:
        try:
            with_requests = service.auth.can_read_request_metrics(request)
        except GatewayError as error:
            return error.response()
        return Response(service.metrics.render(with_requests), media_type=CONTENT_TYPE)

    async def no_route(request: Request, exc: HTTPException) -> Response:
        # Starlette's own refusals (plain text otherwise) as OpenAI error bodies.
        method, path = request.method, request.url.path
        if exc.status_code == 405:
            error = GatewayError(405, f"Method {method} is not allowed on {path}.",
                                 code="method_not_allowed")  # fmt: skip
            return error.response(headers=exc.headers)
        return GatewayError(exc.status_code, f"Invalid URL ({method} {path}).",
                            code="not_found").response()  # fmt: skip

    routes = [
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/embeddings", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/load_lora_adapter", change_adapters, methods=["POST"]),
        Route("/v1/unload_lora_adapter", change_adapters, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: no_route})
    app.state.service = service
    max_body_mb = service.config.request_limits.max_body_mb
    app.add_middleware(BodySizeLimit, max_bytes=max_body_mb * 2**20)
    return app


async def _models_from_replica(service: GatewayService, tenant: Tenant) -> Response:
    """Each model's replicas serve it (and its LoRA adapters) under their names: ask a ready
    stable one of each model, and list only what the tenant may use. One model: its
    replica's answer as is (filtered); several: the cards of every model that answered
    (503 only when none did)."""
    models = [None, *service.catalog.others]
    listings = []
    for model in models:
        response = await _ask_models(service, model)
        if response is None:
            continue
        if len(models) == 1 and response.status_code != 200:
            return Response(response.content, status_code=response.status_code,
                            media_type="application/json")  # fmt: skip
        if response.status_code == 200:
            listings.append(response.json())
    if not listings:
        raise unavailable("no replica is ready to serve; retry shortly")
    listing = {**listings[0], "data": [card for each in listings for card in each["data"]]}
    restricted = tenant.config.allowed_models is not None or tenant.private_adapters
    if restricted:
        listing["data"] = [card for card in listing["data"] if tenant.may_use(card["id"])]
    return Response(json.dumps(listing).encode(), media_type="application/json")


async def _ask_models(service: GatewayService, model: str | None) -> httpx.Response | None:
    """GET /v1/models of a ready stable replica of `model` (None: none answered)."""
    assert service.client is not None
    for endpoint in service.pool.endpoints(model_group(model)):
        if not endpoint.is_routable:
            continue
        try:
            return await service.client.get(
                f"{endpoint.url}/v1/models",
                headers=service.upstream_headers,
                timeout=service.config.resilience.connect_timeout_s * 5,
            )
        except httpx.HTTPError:
            continue
    return None
