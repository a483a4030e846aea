"""Gateway overhead: the same request sent straight to an upstream and through the gateway.

    .venv/bin/python benchmarks/gateway_overhead.py [--upstream noop|URL] [--requests 2000]

`--upstream noop` (the default) starts a no-op upstream (a tiny Starlette app under
uvicorn that answers a fixed chat completion, whole or as a short SSE stream, at once), so
what is measured is the gateway alone; `--upstream URL` measures against a real replica.
A `modelship gateway` process is started in front of it. Requests alternate direct /
through the gateway over keep-alive connections (one client each), one at a time, for a
non-streaming and a streaming chat request; reported per mode: p50 and p99 latency both
ways and their difference (the overhead). `--profile FILE` runs the gateway under cProfile
and writes its stats there. Prints a table and writes JSON (default
benchmarks/results/gateway_overhead.json).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from modelship.server.process import free_port
from processes import wait_ready

MODEL = "noop"
_ANSWER = {
    "id": "chatcmpl-noop", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
}  # fmt: skip
_CHUNK = {"id": "chatcmpl-noop", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
_EVENTS = [
    {**_CHUNK, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {**_CHUNK, "choices": [{"index": 0, "delta": {"content": "ok"}, "token_ids": [1]}]},
    {**_CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {**_CHUNK, "choices": [], "usage": _ANSWER["usage"]},
]
_STREAM = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in _EVENTS) + b"data: [DONE]\n\n"


def noop_app():
    """An OpenAI-shaped upstream that does no work: a fixed answer, at once."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    answer = json.dumps(_ANSWER).encode()

    async def completions(request: Request) -> Response:
        body = json.loads(await request.body())
        if body.get("stream"):
            return Response(_STREAM, media_type="text/event-stream")
        return Response(answer, media_type="application/json")

    async def ok(_: Request) -> Response:
        return Response(b"", media_type="text/plain")

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    return Starlette(routes=[
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models), Route("/ready", ok), Route("/health", ok),
        Route("/metrics", ok),
    ])  # fmt: skip


def serve_noop(port: int) -> None:
    import uvicorn

    uvicorn.run(noop_app(), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def measure(direct: str, gateway: str, stream: bool, num_requests: int, model: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Say ok."}],
            "max_tokens": 1, "temperature": 0, "stream": stream}  # fmt: skip
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    with httpx.Client(timeout=30) as to_direct, httpx.Client(timeout=30) as to_gateway:
        clients = {"direct": (to_direct, direct), "gateway": (to_gateway, gateway)}
        for i in range(num_requests + 50):  # the first 50 of each warm up
            for name in ("direct", "gateway") if i % 2 else ("gateway", "direct"):
                client, url = clients[name]
                started = time.perf_counter()
                response = client.post(f"{url}/v1/chat/completions", json=body)
                response.read()
                elapsed = time.perf_counter() - started
                assert response.status_code == 200, response.text
                if i >= 50:
                    times[name].append(elapsed)
    row = {"mode": "stream" if stream else "whole", "requests": num_requests}
    for name, samples in times.items():
        cuts = statistics.quantiles(samples, n=100)
        row[f"{name}_p50_ms"] = round(statistics.median(samples) * 1000, 3)
        row[f"{name}_p99_ms"] = round(cuts[98] * 1000, 3)
    row["overhead_p50_ms"] = round(row["gateway_p50_ms"] - row["direct_p50_ms"], 3)
    row["overhead_p99_ms"] = round(row["gateway_p99_ms"] - row["direct_p99_ms"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", default="noop", help="noop, or a replica's URL")
    parser.add_argument("--model", default=MODEL, help="the model name a real upstream serves")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--profile", type=Path, help="write the gateway's cProfile stats here")
    default_out = Path("benchmarks/results/gateway_overhead.json")
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--serve-noop", type=int, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.serve_noop:
        return serve_noop(args.serve_noop)

    processes: list[subprocess.Popen] = []
    workdir = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    try:
        upstream = args.upstream
        if upstream == "noop":
            port = free_port()
            processes.append(subprocess.Popen(
                [sys.executable, __file__, "--serve-noop", str(port)]))  # fmt: skip
            upstream = f"http://127.0.0.1:{port}"
            wait_ready(upstream, processes[-1])
        config = workdir / "pipeline.yaml"
        config.write_text(yaml.safe_dump({"gateway": {"routing": {"policy": "round_robin"}}}))
        port = free_port()
        profile = ["-m", "cProfile", "-o", str(args.profile)] if args.profile else []
        gateway_log = open(workdir / "gateway.log", "w")  # noqa: SIM115 - closed with the run
        processes.append(subprocess.Popen(
            [sys.executable, *profile, "-m", "modelship", "gateway", "--config", str(config),
             "--endpoint", upstream, "--port", str(port)],
            stdout=gateway_log, stderr=subprocess.STDOUT,
        ))  # fmt: skip
        gateway = f"http://127.0.0.1:{port}"
        wait_ready(gateway, processes[-1])
        rows = [measure(upstream, gateway, stream, args.requests, args.model)
                for stream in (False, True)]  # fmt: skip
    finally:
        for process in reversed(processes):
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    header = ["mode", "direct_p50_ms", "gateway_p50_ms", "overhead_p50_ms", "direct_p99_ms",
              "gateway_p99_ms", "overhead_p99_ms"]  # fmt: skip
    print(" | ".join(f"{h:>15}" for h in header))
    for row in rows:
        print(" | ".join(f"{row[h]!s:>15}" for h in header))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"upstream": args.upstream, "requests": args.requests, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
