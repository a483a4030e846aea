"""A stand-in for vLLM's OpenAI server, for the gateway's tests: a real HTTP server on
127.0.0.1, in its own process, that answers as `vllm serve` does where the gateway
depends on it (no model behind it: every completion is the same few words).

- `GET /health` 200 with an empty body; there is no `/ready` (404 `{"detail": "Not
  Found"}`, FastAPI's own answer).
- `GET /metrics` with vLLM's `vllm:` names.
- `POST /v1/completions`: the request's `priority` must be 0 unless the server runs with
  `--scheduling-policy priority` (then lower values are scheduled first); otherwise a 400
  with vLLM's current error body, `{"error": {"message", "type": "BadRequestError",
  "param", "code": 400}}` (vLLM 0.10 and earlier answered the fields at the top level
  with `"object": "error"`). Unknown fields (`resume_token_ids`) are ignored, as vLLM
  ignores them (it only logs them). Streams are SSE chunks, a usage chunk when
  `stream_options.include_usage`, then `data: [DONE]`.

    python tests/vllm_stand_in.py [--scheduling-policy fcfs|priority] [--break-after N]

`--break-after N`: a stream's connection is cut after N chunks (a replica dying
mid-stream). Prints its port, then serves until killed; `GET /requests` answers the
completion bodies received, in order. Standard library only; `VllmStandIn` runs it.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

WORDS = [" one", " two", " three", " four", " five", " six", " seven", " eight"]


class VllmStandIn:
    """The server as a child process; `url` once it listens."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.process.stdout.readline())}"

    def requests(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.url}/requests", timeout=5).json()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def error_body(message: str, status: int, error_type: str = "BadRequestError") -> bytes:
    error = {"message": message, "type": error_type, "param": None, "code": status}
    return json.dumps({"error": error}).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args) -> None:  # quiet
        pass

    def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(200, b"")
        elif self.path == "/metrics":
            text = ('vllm:num_requests_running{model_name="m"} 0.0\n'
                    'vllm:num_requests_waiting{model_name="m"} 0.0\n')  # fmt: skip
            self._answer(200, text.encode(), "text/plain; version=0.0.4")
        elif self.path == "/requests":
            with self.server.lock:
                self._answer(200, json.dumps(self.server.received).encode())
        else:
            self._answer(404, b'{"detail":"Not Found"}')

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path != "/v1/completions":
            self._answer(404, b'{"detail":"Not Found"}')
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self._answer(400, error_body("JSON decode error", 400))
            return
        with self.server.lock:
            self.server.received.append(body)
        priority = body.get("priority", 0)
        if priority != 0 and self.server.scheduling_policy != "priority":
            message = f"Got priority {priority} but Priority scheduling is not enabled."
            self._answer(400, error_body(message, 400))
            return
        num_tokens = min(int(body.get("max_tokens") or 16), len(WORDS))
        if body.get("stream"):
            self._stream(body, num_tokens)
            return
        choice = {"index": 0, "text": "".join(WORDS[:num_tokens]), "logprobs": None,
                  "finish_reason": "length", "stop_reason": None}  # fmt: skip
        self._answer(200, json.dumps(self._completion(body, [choice], num_tokens)).encode())

    def _completion(self, body: dict, choices: list, num_tokens: int | None) -> dict:
        answer: dict[str, Any] = {
            "id": "cmpl-standin",
            "object": "text_completion",
            "created": 0,
            "model": body.get("model"),
            "choices": choices,
        }
        if num_tokens is not None:
            answer["usage"] = {"prompt_tokens": 2, "completion_tokens": num_tokens,
                               "total_tokens": 2 + num_tokens}  # fmt: skip
        return answer

    def _stream(self, body: dict, num_tokens: int) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        events = []
        for i in range(num_tokens):
            last = i == num_tokens - 1
            choice = {
                "index": 0,
                "text": WORDS[i],
                "logprobs": None,
                "finish_reason": "length" if last else None,
                "stop_reason": None,
            }
            events.append(self._completion(body, [choice], None))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(self._completion(body, [], num_tokens))
        for i, event in enumerate(events):
            if i == self.server.break_after:  # the replica dies mid-stream
                self.close_connection = True
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self._chunk(f"data: {json.dumps(event)}\n\n".encode())
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, scheduling_policy: str, break_after: int | None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.scheduling_policy = scheduling_policy
        self.break_after = break_after
        self.lock = threading.Lock()
        self.received: list[dict] = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    parser.add_argument("--break-after", type=int, default=None)
    args = parser.parse_args()
    server = _Server(args.scheduling_policy, args.break_after)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
