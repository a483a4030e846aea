"""The FastAPI app: routes that delegate to `serving`, auth, errors, health and drain."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from modelship.body_limit import BodySizeLimit
from modelship.engine import EngineClient, EngineRequest, SamplingParams
from modelship.server import protocol as p
from modelship.server.chat import create_chat_completion
from modelship.server.completions import create_completion
from modelship.server.embeddings import create_embedding
from modelship.server.errors import (
    APIError,
    AuthenticationError,
    BadRequestError,
    ModelNotFoundError,
    RouteError,
    UnavailableError,
)
from modelship.server.gateway_hints import GatewayHints
from modelship.server.limits import RequestLimitsConfig
from modelship.server.metrics import CONTENT_TYPE, ServerMetrics
from modelship.server.openai_translation import OpenAIServing, sse
from modelship.server.reasoning import ReasoningParser
from modelship.server.responses import create_response
from modelship.server.token_limit import TokenIdLimit
from modelship.server.tracing import TracingMiddleware
from modelship.tracing import Tracing

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """Lifecycle flags read by /ready and by the drain logic."""

    ready: bool = False
    draining: bool = False
    num_inflight: int = 0


def create_app(
    engine: EngineClient,
    model_name: str,
    *,
    variant: str = "base",
    api_key: str | None = None,
    max_model_len: int | None = None,
    limits: RequestLimitsConfig | None = None,
    stall_timeout_s: float = 120.0,
    tracing: Tracing | None = None,
    adapters: Mapping[str, str] | None = None,  # name -> folder, served from the start
    lora_admin: bool = False,
    tool_call_parser: str = "auto",
    reasoning_parser: ReasoningParser = ReasoningParser.auto,
) -> FastAPI:
    """Build the OpenAI-compatible app for one engine (warm-up runs at startup).

    An engine step running longer than `stall_timeout_s` is taken for a wedged engine:
    /ready and /health answer 503 ("stalled"), so routers stop sending it requests and a
    supervisor restarts the replica."""
    state = ServerState()
    metrics = ServerMetrics(engine.stats, model_name, variant)
    serving = OpenAIServing(
        engine,
        model_name,
        max_model_len or engine.max_model_len,
        metrics,
        limits,
        tracing,
        adapters,
        tool_call_parser,
        reasoning_parser,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # One real step before reporting ready: weights paged in, kernels initialized.
        warmup = EngineRequest("warmup", [0, 1, 2, 3], SamplingParams(max_tokens=1))
        stream = await engine.add_request(warmup)
        async for _ in stream:
            pass
        state.ready = True
        logger.info("ready: serving %s (%s)", model_name, variant)
        yield
        engine.shutdown()

    app = FastAPI(title="modelship", lifespan=lifespan)
    app.state.server = state

    app.add_middleware(InflightMiddleware, state=state)
    # Inside the body cap: bounds token-id lists before pydantic validates them.
    app.add_middleware(TokenIdLimit, max_model_len=serving.max_model_len, limits=serving.limits)
    max_body_mb = (limits or RequestLimitsConfig()).max_body_mb
    app.add_middleware(BodySizeLimit, max_bytes=max_body_mb * 2**20)
    if tracing is not None and tracing.is_enabled:  # off: not even a pass-through layer
        app.add_middleware(TracingMiddleware, tracing=tracing, model_name=model_name,
                           variant=variant)  # fmt: skip

    async def authenticate(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise AuthenticationError("Incorrect or missing API key.")

    def hints(request: Request) -> GatewayHints:
        """The gateway's settings for the request (cache namespace, input cap, failover
        fields), trusted only from holders of the API key (the routes checked it): with no
        key, every request shares the one unsalted namespace and none may resume."""
        return GatewayHints.from_headers(request.headers, has_api_key=api_key is not None)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _error_response(_BadJSON())
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = first.get("msg", "invalid request")
        if loc:  # else a whole-body check, whose message names the field itself
            message = f"{'.'.join(loc)}: {message}"
        return _error_response(BadRequestError(message, ".".join(loc) or None))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI's and Starlette's own refusals, which would answer {"detail": ...}: a body
        # that is no JSON it could decode (400: not UTF-8, nested past the recursion limit,
        # an integer of more than 4300 digits), an unknown path, a method a route lacks.
        if exc.status_code == 400:
            return _error_response(_BadJSON())
        error = RouteError(
            exc.status_code, request.method, request.url.path, str(exc.detail), exc.headers
        )
        return _error_response(error)

    def stalled() -> bool:
        return engine.stalled_s > stall_timeout_s

    @app.get("/health")
    async def health() -> Response:
        # A dead or wedged engine never recovers: unhealthy, so a supervisor restarts us.
        return Response(status_code=503 if engine.is_dead or stalled() else 200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = state.ready and not state.draining and not engine.is_dead and not stalled()
        if engine.is_dead:
            status = "dead"
        elif stalled():
            status = "stalled"
        else:
            status = "ready" if ok else ("draining" if state.draining else "starting")
        # The variant tells a gateway in front of addresses (Kubernetes) what it routes to.
        body = {"status": status, "variant": variant}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(authenticate)])
    async def models() -> p.ModelList:
        cards = [p.ModelCard(id=model_name, max_model_len=serving.max_model_len)]
        cards += [
            p.ModelCard(id=name, parent=model_name, max_model_len=serving.max_model_len)
            for name in serving.adapters
        ]
        return p.ModelList(data=cards)

    def check_lora_admin() -> None:
        if not lora_admin:
            raise ModelNotFoundError(
                "loading LoRA adapters at runtime is off on this server "
                "(start it with --enable-lora-admin)"
            )

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(authenticate)])
    async def load_lora_adapter(body: p.LoadLoRAAdapterRequest) -> JSONResponse:
        check_lora_admin()
        if not await serving.load_adapter(body):  # served from that folder already
            status = "already_loaded"
        else:
            status = "loaded"
            logger.info("LoRA adapter %s loaded from %s", body.lora_name, body.lora_path)
        return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "status": status})

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(authenticate)])
    async def unload_lora_adapter(body: p.UnloadLoRAAdapterRequest) -> JSONResponse:
        check_lora_admin()
        await serving.unload_adapter(body)
        logger.info("LoRA adapter %s unloaded", body.lora_name)
        return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "status": "unloaded"})

    @app.post("/v1/chat/completions", dependencies=[Depends(authenticate)])
    async def chat(body: p.ChatCompletionRequest, request: Request):
        return await _respond(request, create_chat_completion(serving, body, hints(request)))

    @app.post("/v1/completions", dependencies=[Depends(authenticate)])
    async def completions(body: p.CompletionRequest, request: Request):
        return await _respond(request, create_completion(serving, body, hints(request)))

    @app.post("/v1/embeddings", dependencies=[Depends(authenticate)])
    async def embeddings(body: p.EmbeddingRequest, request: Request):
        return await _respond(request, create_embedding(serving, body, hints(request)))

    @app.post("/v1/responses", dependencies=[Depends(authenticate)])
    async def responses(body: dict[str, Any], request: Request):
        return await _respond(request, create_response(serving, body, hints(request)))

    return app


class InflightMiddleware:
    """Counts API requests until their last byte is sent (streams included) and refuses
    new ones while draining. Pure ASGI: Starlette's `BaseHTTPMiddleware` would hide client
    disconnects from streaming responses, and those must abort the request."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            error = UnavailableError("the server is draining; retry on another replica")
            await _error_response(error)(scope, receive, send)
            return
        self.state.num_inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_inflight -= 1


class _BadJSON(APIError):
    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self) -> None:
        super().__init__("We could not parse the JSON body of your request.")


async def _respond(request: Request, work) -> Response:
    """Run a handler; abort it if the client disconnects before a whole response is ready."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if not done and await request.is_disconnected():
            task.cancel()  # cancelling closes the engine stream, which aborts the request
            return Response(status_code=499)
    result = task.result()
    if isinstance(result, p.BaseModel):
        return JSONResponse(result.model_dump())
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(_with_error_event(result), media_type="text/event-stream")


async def _with_error_event(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream that fails after its headers were sent ends with an OpenAI error event (the
    `openai` SDK raises it as `APIError`) and no `[DONE]`, instead of a cut connection."""
    try:
        async with aclosing(chunks):  # a client that hangs up closes both: the request aborts
            async for chunk in chunks:
                yield chunk
    except APIError as exc:
        logger.warning("stream failed: %s", exc.message)
        yield sse(p.ErrorResponse.of(exc.message, exc.error_type, exc.param, exc.code))
    except Exception:
        logger.exception("stream failed")
        yield sse(p.ErrorResponse.of("internal error while streaming", "server_error", None, None))


def _error_response(exc: APIError) -> JSONResponse:
    body = p.ErrorResponse.of(exc.message, exc.error_type, exc.param, exc.code)
    return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)
