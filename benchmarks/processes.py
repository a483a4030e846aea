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

from kube_stand_in import KubeStandIn
from modelship.config import ModelshipConfig
from modelship.gateway.discovery import RELEASE_LABEL
from modelship.server.process import ReplicaProcess, free_port


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


class GatewayFleet:
    """A gateway (`process`, logging to `log`, answering at `url`) in front of replicas of
    one model; `headers` authenticate a client where the config sets `serve.api_key` (the
    gateway's and the replicas' key)."""

    def __init__(self, config: dict, workdir: Path, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        key = config.get("serve", {}).get("api_key")
        self.headers = {"authorization": f"Bearer {key}"} if key else {}
        self.log = open(workdir / f"{name}.log", "w")  # noqa: SIM115 - closed in stop()
        self.process: subprocess.Popen

    def metrics(self, url: str | None = None) -> dict[str, float]:
        """Every sample of the gateway's (or `url`'s) /metrics, summed over its labels."""
        text = httpx.get(f"{url or self.url}/metrics", headers=self.headers, timeout=10).text
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
                text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=2).text
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

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


class UpFleet(GatewayFleet):
    """`modelship up --config CONFIG` for one model, started now; its log in `workdir`."""

    def __init__(self, config: dict, storage_root: Path, slug: str, workdir: Path, name: str):
        super().__init__(config, workdir, name)
        config = {**config, "gateway": {**config.get("gateway", {}), "port": self.port}}
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "modelship", "up", "--config", str(path),
                   "--storage", str(storage_root), "--model", slug]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

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


class DiscoveryFleet(GatewayFleet):
    """`modelship gateway` finding its replicas in a stand-in Kubernetes API
    (`kube_stand_in.py`), as the rendered gateway finds the engine pods: `num_replicas`
    `modelship serve` processes of `model_dir`, started with the options `modelship up`
    gives its replicas (`ModelshipConfig.replica_options` of `config`) and each, once ready,
    a pod of the headless Service `service` in an EndpointSlice of its own, labelled with
    `release`. The gateway runs `config` with `gateway.discovery` pointed at the stand-in."""

    def __init__(
        self,
        config: dict,
        model_dir: Path,
        slug: str,
        workdir: Path,
        name: str,
        num_replicas: int,
        release: str,
        service: str = "engine",
    ) -> None:
        super().__init__(config, workdir, name)
        self.kube = KubeStandIn().start()
        options = ModelshipConfig.from_dict(config).replica_options(served_model_name=slug)
        key = config.get("serve", {}).get("api_key")
        self.replicas = [
            ReplicaProcess(model_dir, *options.replica_args(), api_key=key,
                           log_path=workdir / f"{name}-pod-{i}.log", die_with_parent=True)
            for i in range(num_replicas)
        ]  # fmt: skip
        for i, replica in enumerate(self.replicas):
            replica.wait_ready()
            # Named as a Deployment's ReplicaSet names its pods: the gateway's endpoint ids.
            self.kube.put_pod(service, f"{service}-7c9d5b-{i:05d}", replica.port,
                              labels={RELEASE_LABEL: release})  # fmt: skip
        discovery = {"services": [service], "namespace": self.kube.namespace,
                     "api_server": self.kube.url}  # fmt: skip
        config = {**config, "gateway": {**config.get("gateway", {}), "discovery": discovery}}
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "modelship", "gateway", "--config", str(path),
                   "--host", "127.0.0.1", "--port", str(self.port)]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def replica_urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    def stop(self) -> None:
        super().stop()
        for replica in self.replicas:
            replica.stop()
        self.kube.stop()
