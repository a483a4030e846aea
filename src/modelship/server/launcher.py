"""Run the server under uvicorn with a graceful drain on SIGTERM/SIGINT.

Drain: the first signal marks the server not ready (/ready answers 503) and makes new API
requests fail fast with 503, while in-flight requests (streams included) run to the end;
when none is left, or the grace period is over, uvicorn is told to exit, and the process
exits 0. A second signal exits at once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import uvicorn

from modelship.engine import AsyncLLMEngine, EngineClient, EngineConfig, EngineCoreClient
from modelship.http_limits import uvicorn_http_options
from modelship.logs import uvicorn_log_config
from modelship.server.app import ServerState, create_app
from modelship.server.limits import RequestLimitsConfig
from modelship.server.reasoning import ReasoningParser
from modelship.tracing import Tracing, TracingConfig

logger = logging.getLogger(__name__)

# `serve` returns this when the server did not start (uvicorn's code for a failed startup:
# the warm-up step raised, or the address could not be had).
STARTUP_FAILED_EXIT_CODE = 3


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, grace_period_s: float):
        super().__init__(config)
        self.state = state
        self.grace_period_s = grace_period_s

    def handle_exit(self, sig: int, frame) -> None:  # called from the signal handler
        if self.state.draining:
            return super().handle_exit(sig, frame)  # second signal: stop now
        self.state.draining = True
        logger.info("draining: %d requests in flight", self.state.num_inflight)
        threading.Thread(target=self._wait_then_exit, daemon=True).start()

    def _wait_then_exit(self) -> None:
        deadline = time.monotonic() + self.grace_period_s
        while self.state.num_inflight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.state.num_inflight:
            logger.warning("grace period over with %d requests in flight", self.state.num_inflight)
        self.should_exit = True


def serve(
    model_dir: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    api_key: str | None = None,
    variant: str = "base",
    grace_period_s: float = 30.0,
    engine_config: EngineConfig | None = None,
    sock: socket.socket | None = None,
    limits: RequestLimitsConfig | None = None,
    engine_process: bool = True,
    stall_timeout_s: float = 120.0,
    tracing: TracingConfig | None = None,
    lora_admin: bool = False,
    tool_call_parser: str = "auto",
    reasoning_parser: ReasoningParser = ReasoningParser.auto,
) -> int:
    """Load the model, warm it up, serve until drained; returns the exit code. With `sock`
    (a socket bound before the model loads: by `modelship serve`, or by a parent process
    that handed it over), listen on it instead of binding `host`/`port`.
    `engine_process`: the engine core runs in its own process (else on a
    thread of this one); if it dies, the open requests fail and the server exits 1. A step
    running past `stall_timeout_s` makes /ready and /health answer 503."""
    engine_type = EngineCoreClient if engine_process else AsyncLLMEngine
    engine: EngineClient = engine_type.from_model(model_dir, engine_config)
    name = served_model_name or model_dir.resolve().name
    tracer = Tracing(tracing, "modelship-replica")
    app = create_app(
        engine,
        name,
        variant=variant,
        api_key=api_key,
        limits=limits,
        stall_timeout_s=stall_timeout_s,
        tracing=tracer,
        adapters=dict(engine_config.loras) if engine_config else None,
        lora_admin=lora_admin,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=5,
        access_log=False,
        log_config=uvicorn_log_config(),
        **uvicorn_http_options(),  # httptools (or h11) with the request head capped
    )
    if sock is not None:
        logger.info("listening on http://%s:%d", *sock.getsockname()[:2])
    server = DrainingServer(config, app.state.server, grace_period_s)
    if isinstance(engine, EngineCoreClient):

        def on_death() -> None:  # the open requests have failed already: let them flush
            server.should_exit = True

        engine.on_death = on_death
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        tracer.shutdown()  # export the spans still batched
    if not server.started:
        return STARTUP_FAILED_EXIT_CODE
    if isinstance(engine, EngineCoreClient) and engine.crashed:
        logger.error("exiting: the engine core died")
        return 1
    return 0
