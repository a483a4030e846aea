"""The fuzz drill's raw-socket half: clients that misbehave below the API (slow-loris
headers and bodies, streams nobody reads, hang-ups mid-stream), and what each must leave
behind on the replica (answers for everyone else, bounded memory, free KV blocks)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

from drill.common import DrillResult, is_openai_error, metric, wait_until

TIMEOUT_S = 60.0  # any one request
RSS_BOUND_MIB = 64  # growth of the replica while clients never read their streams
PROBE_S = 2.5  # the slowest /ready allowed during a token-id flood (it stalled 5 s and more)
# Tokens of each silent stream's sequences: enough for 3 x 16 of them to overflow the demo
# model's KV cache under the drill's settings (22 blocks, 3 per sequence), few enough to
# finish in minutes on a CPU. Without it they ran to the context length, 12,000 tokens at
# ~10 a second, and "generated to the end" could not pass.
SILENT_MAX_TOKENS = 32
SILENT_S_PER_SEQUENCE = 2.5  # the wait for them all to finish, per sequence


def answers(url: str, model: str, headers: dict[str, str] | None = None) -> bool:
    """Whether an ordinary completion is answered 200."""
    body = {"model": model, "prompt": "still there?", "max_tokens": 2}
    try:
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers or {},
                              timeout=TIMEOUT_S)  # fmt: skip
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def slow_clients(
    result: DrillResult, url: str, model: str, num_clients: int, seconds: float
) -> None:
    """Slow-loris: connections trickling headers (half) or a body (the other half) a byte at
    a time, while ordinary requests must still be answered."""
    stop = threading.Event()
    host, port = _address(url)
    body = _json({"model": model, "prompt": "slow", "max_tokens": 2})

    # Enough bytes to trickle for the whole drill, one every `interval_s`.
    interval_s = 0.05
    pad = b" " * int(seconds / interval_s + 100)

    def trickle(index: int) -> None:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n"
        if index % 2:  # the whole head at once, then the body (JSON, then blanks) slowly
            slow = body + pad
            head += f"Content-Length: {len(slow)}\r\n\r\n".encode()
        else:  # the head itself never ends
            slow = b"X-Slow: " + pad
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
            sock.sendall(head)
            for byte in slow[:-1]:  # never the last byte
                if stop.wait(interval_s):
                    return
                sock.sendall(bytes([byte]))

    threads = [threading.Thread(target=trickle, args=(i,), daemon=True)
               for i in range(num_clients)]  # fmt: skip
    for thread in threads:
        thread.start()
    latencies, failures = [], []
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        while time.monotonic() < deadline:
            started = time.monotonic()
            try:
                response = client.post("/v1/completions", content=body,
                                       headers={"content-type": "application/json"})  # fmt: skip
                if response.status_code != 200:
                    failures.append(f"{response.status_code}: {response.text[:200]}")
            except httpx.HTTPError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
            latencies.append(time.monotonic() - started)
    still_trickling = sum(thread.is_alive() for thread in threads)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    result.figures["slow_clients"] = num_clients
    result.figures["requests_beside_slow_clients"] = len(latencies)
    result.figures["max_latency_beside_slow_clients_s"] = round(max(latencies, default=0), 2)
    result.check(
        "slow clients hold up nobody",
        latencies and not failures and still_trickling == num_clients,
        f"{len(latencies)} requests beside {still_trickling}/{num_clients} slow "
        f"clients still trickling, failures: {failures[:3]}",
    )


def silent_readers(result: DrillResult, url: str, pid: int, model: str, num_readers: int) -> None:
    """Streams whose clients never read (a small receive window), 16 completions each: an
    ordinary request sent while they run is answered; the replica generates them to the end
    and must buffer no more than what backpressure lets through."""
    request = {"model": model, "prompt": "never read", "stream": True, "n": 16, "logprobs": 20,
               "ignore_eos": True, "max_tokens": SILENT_MAX_TOKENS}  # fmt: skip
    rss_before = psutil.Process(pid).memory_info().rss
    num_sequences = 16 * num_readers

    def num_finished() -> float:
        return metric(url, "modelship:request_success_total", finished_reason="length")

    finished_before = num_finished()
    sockets = []
    try:
        for _ in range(num_readers):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(_address(url))
            sock.sendall(_http_post("/v1/completions", request))
            sockets.append(sock)
        # The ordinary request goes in behind the streams (on a fast model they may be done
        # by then: this wait ends either way).
        wait_until(lambda: _num_in_engine(url) > 0 or num_finished() > finished_before, 10, 0.05)
        started = time.monotonic()
        answered = answers(url, model)
        answer_s = time.monotonic() - started
        finished = wait_until(lambda: num_finished() - finished_before >= num_sequences,
                              SILENT_S_PER_SEQUENCE * num_sequences, 0.5)  # fmt: skip
        rss_after = psutil.Process(pid).memory_info().rss
    finally:
        for sock in sockets:
            sock.close()
    growth_mib = (rss_after - rss_before) / 2**20
    result.figures["silent_readers"] = num_readers
    result.figures["answer_beside_silent_readers_s"] = round(answer_s, 2)
    result.figures["rss_before_mib"] = round(rss_before / 2**20)
    result.figures["rss_growth_mib"] = round(growth_mib, 1)
    result.figures["rss_bound_mib"] = RSS_BOUND_MIB
    result.check(
        "clients that never read: others answered meanwhile, generated to the end, memory bounded",
        answered and finished and growth_mib <= RSS_BOUND_MIB,
        f"another request answered while they ran: {answered} ({answer_s:.1f} s), "
        f"{num_sequences} sequences of {SILENT_MAX_TOKENS} tokens generated to the end: "
        f"{finished}, RSS +{growth_mib:.1f} MiB (bound {RSS_BOUND_MIB})",
    )
    freed = wait_until(lambda: _kv_free(url), 30)
    result.check("KV blocks free after the silent readers left", freed,
                 f"kv usage {metric(url, 'modelship:kv_cache_usage_perc')}")  # fmt: skip


def disconnects(
    result: DrillResult,
    name: str,
    url: str,
    replica_url: str,
    model: str,
    count: int,
    headers: dict[str, str] | None = None,
) -> None:
    """`count` streams, each dropped after its first event (every other one with a RST),
    eight at a time; then nothing may run on the replica and every KV block is free."""
    host, port = _address(url)

    def drop(index: int) -> bool | str:
        request = {"model": model, "prompt": f"hang up {index}", "max_tokens": 200,
                   "stream": True, "ignore_eos": True}  # fmt: skip
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
            sock.sendall(_http_post("/v1/completions", request, headers))
            seen = b""
            while b"data:" not in seen:
                chunk = sock.recv(4096)
                if not chunk:
                    return f"closed after {seen[:300]!r}"
                seen += chunk
            if index % 2:  # RST instead of FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            return seen.startswith(b"HTTP/1.1 200") or repr(seen[:300])

    def num_aborted() -> float:
        return metric(replica_url, "modelship:request_success_total", finished_reason="abort")

    aborted_before = num_aborted()
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(_quietly(drop), range(count)))
    freed = wait_until(lambda: _num_in_engine(replica_url) == 0 and _kv_free(replica_url), 60)
    num_aborted_now = num_aborted() - aborted_before
    result.figures[f"{name}_disconnects"] = count
    result.figures[f"{name}_disconnects_aborted"] = int(num_aborted_now)
    errors = [o for o in outcomes if isinstance(o, str)]
    result.check(
        f"{name}: {count} hang-ups mid-stream, each aborted, then nothing runs and every KV "
        "block is free",
        freed and outcomes.count(True) == count and num_aborted_now == count,
        f"streams started {outcomes.count(True)}/{count} (errors {errors[:3]}), aborted "
        f"{num_aborted_now}, "
        f"in engine {_num_in_engine(replica_url)}, "
        f"kv usage {metric(replica_url, 'modelship:kv_cache_usage_perc')}",
    )


def _num_in_engine(url: str) -> float:
    return metric(url, "modelship:num_requests_running") + metric(
        url, "modelship:num_requests_waiting"
    )


def _kv_free(url: str) -> bool:
    return metric(url, "modelship:kv_cache_usage_perc") == 0


def _http_post(
    path: str, body: dict, headers: dict[str, str] | None = None, request_id: bytes | None = None
) -> bytes:
    """The raw request; `request_id` as sent, whatever bytes it holds."""
    raw = _json(body)
    lines = [f"POST {path} HTTP/1.1", "Host: fuzz", "Content-Type: application/json",
             f"Content-Length: {len(raw)}"]  # fmt: skip
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    head = "\r\n".join(lines).encode() + b"\r\n"
    if request_id is not None:
        head += b"X-Request-Id: " + request_id + b"\r\n"
    return head + b"\r\n" + raw


def _address(url: str) -> tuple[str, int]:
    parsed = httpx.URL(url)
    return parsed.host, parsed.port or 80


def _quietly(work: Callable[[int], bool | str]) -> Callable[[int], bool | str]:
    def wrapped(index: int) -> bool | str:
        try:
            return work(index)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"

    return wrapped


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


def head_flood(result: DrillResult, name: str, url: str, path: str) -> None:
    """A request head that never ends (4 MiB of one header, no Authorization): refused
    with a 431 and an OpenAI error body while it streams in, and the server answers on."""
    host, port = _address(url)
    answer = b""
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: fuzz\r\nX-Flood: ".encode())
            with contextlib.suppress(OSError):  # closed once it answered
                for _ in range(64):
                    sock.sendall(b"a" * 2**16)
            while chunk := sock.recv(65536):
                answer += chunk
    except OSError as exc:
        answer += f" ({type(exc).__name__}: {exc})".encode()
    head, _, body = answer.partition(b"\r\n\r\n")
    is_openai = is_openai_error(httpx.Response(431, content=body))
    refused = head.startswith(b"HTTP/1.1 431") and is_openai
    answered = answers_health(url)
    result.check(
        f"{name}: a request head past 64 KiB is a 431 while it streams in",
        refused and answered,
        f"answer {answer[:200]!r}, answering after: {answered}",
    )


def odd_request_ids(
    result: DrillResult, name: str, url: str, model: str, headers: dict[str, str] | None = None
) -> None:
    """Requests on one keep-alive connection whose `x-request-id` is not ASCII, too long or
    holds a space: each answered 200 under an id of the server's, the connection kept."""
    host, port = _address(url)
    body = {"model": model, "prompt": "id", "max_tokens": 2}
    odd = ["\u00e9t\u00e9".encode(), b"a" * 129, b"a b", b"\xff"]
    answers_seen = []
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
            reader = sock.makefile("rb")
            for request_id in odd:
                sock.sendall(_http_post("/v1/completions", body, headers, request_id))
                answers_seen.append(_read_response(reader))
    except OSError as exc:
        answers_seen.append(f"{type(exc).__name__}: {exc}")
    ok = len(answers_seen) == len(odd) and all(a == 200 for a in answers_seen)
    result.check(f"{name}: odd x-request-id values answered 200 on one connection", ok,
                 f"answers {answers_seen}")  # fmt: skip


def token_id_flood(
    result: DrillResult, name: str, url: str, model: str, headers: dict[str, str] | None = None
) -> None:
    """A completion of 4 million token ids (7.6 MiB): a 400 naming `prompt`, while the
    replica's /ready (or the gateway's) keeps answering within `PROBE_S`."""
    ids = ",".join(["0"] * 4_000_000)
    body = f'{{"model": "{model}", "max_tokens": 1, "prompt": [{ids}]}}'.encode()
    slowest = [0.0]
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            started = time.monotonic()
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{url}/ready", timeout=TIMEOUT_S)
            slowest[0] = max(slowest[0], time.monotonic() - started)
            done.wait(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        headers = {"content-type": "application/json", **(headers or {})}
        response = httpx.post(
            f"{url}/v1/completions", content=body, headers=headers, timeout=TIMEOUT_S
        )
        status, error = response.status_code, response.json().get("error") or {}
    except (httpx.HTTPError, ValueError) as exc:
        status, error = 0, {"message": f"{type(exc).__name__}: {exc}"}
    finally:
        done.set()
        prober.join()
    result.figures[f"{name}_token_flood_slowest_ready_s"] = round(slowest[0], 2)
    result.check(
        f"{name}: 4 million token ids are a 400 naming prompt, /ready answered meanwhile",
        status == 400 and error.get("param") == "prompt" and slowest[0] <= PROBE_S,
        f"status {status}, error {str(error)[:200]}, slowest /ready {slowest[0]:.2f}s "
        f"(bound {PROBE_S}s)",
    )


def answers_health(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


def _read_response(reader) -> int | str:
    """The status of one HTTP/1.1 response read off `reader` (its body skipped)."""
    status_line = reader.readline()
    if not status_line:
        return "connection closed"
    length, chunked = 0, False
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.lower() == "content-length":
            length = int(value)
        chunked |= name.lower() == "transfer-encoding" and "chunked" in value
    if chunked:
        while (size := int(reader.readline().split(b";")[0], 16)) > 0:
            reader.read(size + 2)
        reader.readline()
    else:
        reader.read(length)
    return int(status_line.split()[1])
