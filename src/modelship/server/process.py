"""A `modelship serve` replica as a child process on 127.0.0.1: start, wait for /ready, stop.

Used wherever the code needs a real server it owns: `select` measures each variant through
one, the fleet supervisor runs its replicas with it, tests start one per module.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from modelship.lifetime import parent_death_signal

API_KEY_ENV = "MODELSHIP_API_KEY"  # `modelship serve` reads its key from here


class ReplicaStartError(RuntimeError):
    """The server exited or did not become ready; the message ends with its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now; another process may take it before the caller binds it (tests of
    addresses where nothing listens). `ReplicaProcess` passes its child a bound socket."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to (host, port), not listening yet: connections are refused until
    the process that inherits it listens. Port 0 picks a free port, with no race."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


class ReplicaProcess:
    """One `modelship serve MODEL_DIR` child; `args` are extra serve flags.

    The parent binds the listening socket (port 0: any free port) and the child inherits
    it (`--fd`), so the port is known at once and no other process can take it between
    choosing and binding. A subclass whose command binds its own port sets
    `inherits_socket = False`.

    `api_key` (the key the replica requires) travels in the child's environment, which only
    its user can read, never on its command line, which `ps` shows to everyone. None: no
    key, even when this process has one in its own environment."""

    inherits_socket = True

    def __init__(
        self,
        model_dir: Path,
        *args: str,
        log_path: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        die_with_parent: bool = False,
        api_key: str | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.args = list(args)
        self.host = host
        self._socket = bind_socket(host, port or 0) if self.inherits_socket else None
        if self._socket is not None:
            self.port = self._socket.getsockname()[1]
        else:
            self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        command = self.command()
        self.started_at = time.monotonic()
        self.ready_at: float | None = None
        env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
        if api_key:
            env[API_KEY_ENV] = api_key
        try:
            self.process = subprocess.Popen(
                command,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(self._socket.fileno(),) if self._socket is not None else (),
                preexec_fn=parent_death_signal() if die_with_parent else None,
            )
        finally:
            if self._socket is not None:
                self._socket.close()  # the child holds the port now

    def command(self) -> list[str]:
        assert self._socket is not None
        return [sys.executable, "-m", "modelship", "serve", str(self.model_dir),
                "--fd", str(self._socket.fileno()), *self.args]  # fmt: skip

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
        if not self._log.closed:
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
