"""Start `modelship gateway --config ... [--endpoint URL]... [--canary-endpoint URL]...` as a
real subprocess on 127.0.0.1 (ReplicaProcess's start, readiness and stop)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from modelship.server.process import ReplicaProcess, bind_socket


class GatewayProcess(ReplicaProcess):
    inherits_socket = False  # the gateway binds --port itself

    def __init__(
        self,
        tmp_path: Path,
        gateway: dict,
        *endpoint_args: str,
        api_key: str | None = None,
        sections: dict | None = None,
    ) -> None:
        """`api_key`: the replicas' key (MODELSHIP_API_KEY, as Kubernetes hands it over);
        `sections`: more of pipeline.yaml than its `gateway:` (e.g. `deploy:`, `tracing:`)."""
        config = tmp_path / "pipeline.yaml"
        config.write_text(yaml.safe_dump({"gateway": gateway, **(sections or {})}))
        # The port stays bound here (not listening) until stop(): the gateway binds it beside
        # this socket (both SO_REUSEADDR), and no other process (a test in another pytest-xdist
        # worker) is given it between choosing it and the gateway's own bind.
        self._port_hold = bind_socket("127.0.0.1")
        super().__init__(
            Path("."), "--config", str(config), *endpoint_args, log_path=tmp_path / "gateway.log",
            port=self._port_hold.getsockname()[1], api_key=api_key,
        )  # fmt: skip
        self.metrics_key: str | None = None  # a gateway.metrics_api_key_sha256 key

    def stop(self, timeout_s: float = 30.0) -> int:
        code = super().stop(timeout_s)
        self._port_hold.close()
        return code

    def command(self) -> list[str]:
        return [sys.executable, "-m", "modelship", "gateway", *self.args,
                "--host", self.host, "--port", str(self.port)]  # fmt: skip

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (the series that move
        per request need `metrics_key` on a gateway with API keys)."""
        headers = {"authorization": f"Bearer {self.metrics_key}"} if self.metrics_key else {}
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=5).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )
