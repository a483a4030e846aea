"""A `modelship serve` replica as a child process on 127.0.0.1: start, wait for /ready, stop.

Used wherever the code needs a real server it owns: `select` measures each variant through
one, the fleet supervisor runs its replicas with it, tests start one per module.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


class ReplicaStartError(RuntimeError):
    """The server exited or did not become ready; the message ends with its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM (a drain) when the parent dies, even by kill -9,
    so a crashed fleet supervisor leaves no orphan replicas holding ports and memory."""
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ReplicaProcess:
    """One `modelship serve MODEL_DIR` child; `args` are extra serve flags."""

    def __init__(
        self,
        model_dir: Path,
        *args: str,
        log_path: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        die_with_parent: bool = False,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.args = list(args)
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        command = self.command()
        self.started_at = time.monotonic()
        self.ready_at: float | None = None
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_term_with_parent if die_with_parent else None,
        )

    def command(self) -> list[str]:
        return [sys.executable, "-m", "modelship", "serve", str(self.model_dir),
                "--host", self.host, "--port", str(self.port), *self.args]  # fmt: skip

    @property
    def pid(self) -> int:
        return self.process.pid

    def has_exited(self) -> bool:
        return self.process.poll() is not None

    def kill(self) -> None:
        """SIGKILL: no drain (a replica stuck past its grace period)."""
        if self.process.poll() is None:
            self.process.kill()

    def close_log(self) -> None:
        self._log.close()

    def is_ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Block until /ready answers 200; returns the seconds from start to ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ReplicaStartError(
                    f"server for {self.model_dir} exited with {self.process.returncode}:\n"
                    + self.log_tail()
                )
            if self.is_ready():
                self.ready_at = time.monotonic()
                return self.ready_at - self.started_at
            time.sleep(0.2)
        self.stop()
        raise ReplicaStartError(
            f"server for {self.model_dir} not ready after {timeout_s:.0f}s:\n" + self.log_tail()
        )

    def peak_rss_bytes(self) -> int | None:
        """The process's peak resident set (VmHWM), while it runs (Linux)."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return None
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return None

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def terminate(self) -> None:
        """SIGTERM: the server drains in-flight requests, then exits 0."""
        self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode
