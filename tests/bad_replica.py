"""A misbehaving replica, for fault injection in front of the real gateway: a real HTTP
server on 127.0.0.1, in its own process, that says it is healthy (/health and /ready
answer 200) and fails every completion.

    python tests/bad_replica.py --mode 500|garbage|mixed|hang

`500`: an Internal Server Error (plain text, as a crashed handler answers); `garbage`:
200 with a JSON body cut short, streams included (content-type application/json, no
events); `mixed`: the two in turn; `hang`: never answers (SIGSTOP the process too, and
the health checks fall silent as well). Prints its port, then serves until killed;
GET /count answers how many completion requests came in. Standard library only.
`BadReplica` runs it from a test or a drill.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

GARBAGE = b'{"id": "cmpl-garbage", "object": "chat.completion", "choices": [{"index": 0, "mes'


class BadReplica:
    """The server as a child process; `url` once it listens."""

    def __init__(self, mode: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--mode", mode], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.process.stdout.readline())}"

    def num_requests(self) -> int:
        return httpx.get(f"{self.url}/count", timeout=5).json()["requests"]

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real replica behind a pooled client
    server: _Server

    def log_message(self, format: str, *args) -> None:  # quiet
        pass

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path in ("/health", "/ready"):
            self._answer(200, b'{"status": "ready"}', "application/json")
        elif self.path == "/count":
            count = json.dumps({"requests": self.server.num_requests}).encode()
            self._answer(200, count, "application/json")
        elif self.path == "/metrics":
            self._answer(200, b"", "text/plain")
        else:
            self._answer(404, b"not found", "text/plain")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        mode = self.server.next_mode()
        if mode == "hang":
            time.sleep(3600)
        elif mode == "500":
            self._answer(500, b"Internal Server Error", "text/plain")
        else:
            self._answer(200, GARBAGE, "application/json")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self._modes = itertools.cycle(["500", "garbage"] if mode == "mixed" else [mode])
        self._lock = threading.Lock()
        self.num_requests = 0

    def next_mode(self) -> str:
        with self._lock:
            self.num_requests += 1
            return next(self._modes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["500", "garbage", "mixed", "hang"], default="mixed")
    server = _Server(parser.parse_args().mode)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
