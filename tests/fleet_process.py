"""`modelship up` as a real subprocess on 127.0.0.1, with helpers to look inside it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

from modelship.server.process import bind_socket


class UpProcess:
    def __init__(
        self, config: dict, storage: Path, slug: str, workdir: Path, env: dict | None = None
    ) -> None:
        # Held (bound, not listening) until stop(): the gateway binds the port beside this
        # socket (both SO_REUSEADDR), and no other process (a test in another pytest-xdist
        # worker) is given it while `modelship up` starts.
        self._port_hold = bind_socket("127.0.0.1")
        self.port = self._port_hold.getsockname()[1]
        config = {**config, "gateway": {**config.get("gateway", {}), "port": self.port}}
        self.config_path = workdir / "pipeline.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.storage = storage
        self.slug = slug
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "up.log"
        self.metrics_key: str | None = None  # a gateway.metrics_api_key_sha256 key
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "modelship", *self.cli_args("up")],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def cli_args(self, *command: str) -> list[str]:
        return [*command, "--config", str(self.config_path), "--storage", str(self.storage),
                "--model", self.slug]  # fmt: skip

    def cli(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "modelship", *self.cli_args(*command)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_for(self, condition, timeout_s: float = 120.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"modelship up exited while waiting for {what}:\n{self.log()}")
            try:
                if condition():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; log tail:\n{self.log()[-4000:]}")

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        self.wait_for(
            lambda: httpx.get(f"{self.url}/ready", timeout=1).status_code == 200,
            timeout_s,
            "the gateway to be ready",
        )

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (tenant labels only
        with `metrics_key`)."""
        headers = {"authorization": f"Bearer {self.metrics_key}"} if self.metrics_key else {}
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=5).text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
        return total

    @staticmethod
    def replica_url(replica: psutil.Process) -> str:
        """The replica's address: the port it listens on (inherited, so not on its cmdline)."""
        for conn in replica.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                return f"http://127.0.0.1:{conn.laddr.port}"
        raise AssertionError(f"replica {replica.pid} listens on no TCP port")

    def replicas(self) -> list[psutil.Process]:
        """The replica processes (`modelship serve` children of the fleet)."""
        replicas = []
        try:
            children = psutil.Process(self.process.pid).children()
        except psutil.Error:  # the fleet itself is gone
            return []
        for child in children:
            try:  # a killed replica is a zombie until the supervisor reaps it
                if child.status() != psutil.STATUS_ZOMBIE and "serve" in child.cmdline():
                    replicas.append(child)
            except psutil.Error:
                pass
        return replicas

    @contextlib.contextmanager
    def running(self) -> Iterator[UpProcess]:
        """Ready on entry; stopped on exit, which must drain cleanly (exit code 0)."""
        try:
            self.wait_ready()
            yield self
        finally:
            code = self.stop()
            assert code == 0, self.log()[-3000:]

    def stop(self) -> int:
        """SIGTERM (drain), wait; returns the exit code. Its replicas must be gone too."""
        replicas = self.replicas() if self.process.poll() is None else []
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        self._port_hold.close()
        _, alive = psutil.wait_procs(replicas, timeout=10)
        assert not alive, f"replicas left running: {alive}"
        return self.process.returncode
