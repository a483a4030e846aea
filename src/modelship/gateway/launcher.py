"""Run a gateway app under uvicorn, with a graceful drain on SIGTERM/SIGINT.

The first signal makes /ready answer 503 and new requests 503 (load balancers and
clients move on), lets requests in flight finish within the grace period, then stops
uvicorn; the app's shutdown hooks then drain and stop any replicas it supervises. A
second signal stops at once.

uvicorn runs on uvloop and httptools' HTTP parser (both C): each request costs the gateway
less CPU than on asyncio and h11 (pure Python, the fallback where they are not installed).
"""

from __future__ import annotations

import logging
import threading
import time

import uvicorn
from starlette.applications import Starlette

from modelship.gateway.service import GatewayService
from modelship.http_limits import can_import, uvicorn_http_options
from modelship.logs import uvicorn_log_config

logger = logging.getLogger(__name__)


class DrainingGateway(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: GatewayService, grace_period_s: float):
        super().__init__(config)
        self.service = service
        self.grace_period_s = grace_period_s

    def handle_exit(self, sig: int, frame) -> None:  # called from the signal handler
        if self.service.is_draining:
            return super().handle_exit(sig, frame)
        self.service.is_draining = True
        logger.info("draining: %d requests held", self.service.num_held)
        threading.Thread(target=self._wait_then_exit, daemon=True).start()

    def _wait_then_exit(self) -> None:
        deadline = time.monotonic() + self.grace_period_s
        while self.service.num_held > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True


def server_config(app: Starlette, host: str, port: int) -> uvicorn.Config:
    """uvicorn's settings for the gateway: uvloop and httptools where they import, the
    request head capped either way (`http_limits`)."""
    fast = can_import("uvloop") and can_import("httptools")
    if not fast:
        logger.warning("uvloop or httptools is not installed: the gateway runs on asyncio and "
                       "h11, slower (pip install -c constraints.txt uvloop httptools)")  # fmt: skip
    return uvicorn.Config(
        app, host=host, port=port, log_level="info", access_log=False, timeout_graceful_shutdown=5,
        log_config=uvicorn_log_config(), loop="uvloop" if fast else "asyncio",
        **uvicorn_http_options(use_httptools=fast),
    )  # fmt: skip


def run_gateway(
    app: Starlette, service: GatewayService, host: str, port: int, grace_period_s: float
) -> None:
    DrainingGateway(server_config(app, host, port), service, grace_period_s).run()
