"""Helpers the benchmarks share for the servers they start."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

from modelship.server.process import free_port


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until `url`/ready answers 200; exits the benchmark if `process` dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: the process exited ({process.returncode})")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} was not ready within {timeout_s} s")


class UpFleet:
    """`modelship up --config CONFIG` for one model, started now; its log in `workdir`."""

    def __init__(self, config: dict, storage_root: Path, slug: str, workdir: Path, name: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {**config, "gateway": {**config.get("gateway", {}), "port": self.port}}
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log = open(workdir / f"{name}.log", "w")  # noqa: SIM115 - closed in stop()
        command = [sys.executable, "-m", "modelship", "up", "--config", str(path),
                   "--storage", str(storage_root), "--model", slug]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def metrics(self, url: str | None = None) -> dict[str, float]:
        """Every sample of the gateway's (or `url`'s) /metrics, summed over its labels."""
        text = httpx.get(f"{url or self.url}/metrics", timeout=10).text
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return totals

    def wait_ready(self, num_replicas: int, timeout_s: float = 600) -> None:
        """Until `num_replicas` replicas (of any track or tier) are ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"modelship up exited; see {self.log.name}")
            try:
                text = httpx.get(f"{self.url}/metrics", timeout=2).text
                ready = sum(
                    s.value
                    for f in text_string_to_metric_families(text)
                    for s in f.samples
                    if s.name == "modelship_gateway_replicas" and s.labels.get("state") == "ready"
                )
                if ready == num_replicas:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"the fleet was not ready after {timeout_s:.0f}s; see {self.log.name}")

    def replica_urls(self) -> list[str]:
        urls = []
        for child in psutil.Process(self.process.pid).children():
            if "serve" in child.cmdline():  # its port is an inherited socket, not an argument
                ports = [
                    c.laddr.port
                    for c in child.net_connections(kind="tcp")
                    if c.status == psutil.CONN_LISTEN
                ]
                urls += [f"http://127.0.0.1:{port}" for port in ports]
        return urls

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()
