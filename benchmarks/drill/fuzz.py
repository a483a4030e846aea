"""Drill 1, fuzz the API: generated, hand-written and raw-socket abuse of a replica
(`modelship serve`) and of a gateway (`modelship up`) in front of one.

Provokes: schemathesis cases from the replica's OpenAPI schema (every operation, positive
and negative, half of them with the served model's name so they get past the model check);
extremes no generator aims at (NaN, infinite and negative temperatures, max_tokens, n,
logprobs, top_k and seeds beyond int64, token ids out of the vocabulary, lone surrogates,
megabyte strings, truncated, non-UTF-8 and deeply nested JSON, duplicated keys, unknown
paths and methods); and misbehaving sockets: slow-loris headers and bodies, clients that
never read their stream, clients that hang up mid-stream, a request head that never ends,
4 million token ids in one prompt, `x-request-id` values that are not ASCII or too long.

Pass rules: no 5xx and no error event inside a 200 stream; every 4xx an OpenAI error body;
every request answered within its timeout; the processes alive and answering afterwards;
slow clients hold up nobody; clients that never read hold up nobody either and grow the
server by at most `fuzz_sockets.RSS_BOUND_MIB`; after the hang-ups nothing runs and every
KV block is free (the raw-socket half lives in `fuzz_sockets.py`); a head past 64 KiB is a
431 while it streams in; 4 million token ids are a 400 naming `prompt` while /ready
answers within `fuzz_sockets.PROBE_S`; odd request ids are answered 200 on one keep-alive
connection.

The gateway is a Starlette app with no OpenAPI schema of its own: it proxies the replica's
two POST routes and serves the same GET routes, so it is fuzzed with the replica's schema
at its own URL, with a tenant's API key.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from drill.common import DrillContext, DrillResult, is_openai_error
from drill.fuzz_sockets import (
    answers,
    disconnects,
    head_flood,
    odd_request_ids,
    silent_readers,
    slow_clients,
    token_id_flood,
)

MODEL = "tiny"  # the served model name (replica and gateway)
KEY = "sk-fuzz-drill"
MAX_MODEL_LEN = 256
SERVE_ARGS = ("--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
              "--kv-cache-memory-mb", "16")  # fmt: skip
TIMEOUT_S = 60.0  # any one request; a request not answered by then is a failure
SEED = 20260416
MAX_EXAMPLES_KEPT = 8  # failing requests kept in a check's detail


@dataclass(frozen=True)
class Budget:
    examples: int  # schemathesis cases per operation and generation mode, replica
    gateway_examples: int  # the same through the gateway
    num_slow_clients: int  # slow-loris connections held open at once
    slow_s: float  # how long they trickle
    num_silent_readers: int  # streams nobody reads
    num_disconnects: int  # streams dropped after their first event, replica
    gateway_disconnects: int  # the same through the gateway


QUICK = Budget(30, 10, 8, 4.0, 3, 40, 10)
FULL = Budget(300, 150, 64, 20.0, 16, 1000, 200)


@dataclass
class Tally:
    """What one target answered, and the first few offending requests."""

    num_cases: int = 0
    num_5xx: int = 0
    num_bad_4xx: int = 0  # a 4xx whose body is no OpenAI error
    num_stream_errors: int = 0  # a 200 stream that carried an error event
    num_no_answer: int = 0  # timed out, or the connection broke
    statuses: dict[int, int] = field(default_factory=dict)
    offenders: list[str] = field(default_factory=list)

    def record(self, label: str, status: int, content: bytes) -> None:
        self.num_cases += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        problem = None
        if status >= 500:
            self.num_5xx += 1
            problem = f"{status}"
        elif status >= 400 and not is_openai_error(httpx.Response(status, content=content)):
            self.num_bad_4xx += 1
            problem = f"{status} without an OpenAI error body"
        elif status == 200 and _has_error_event(content):
            self.num_stream_errors += 1
            problem = "error event in a 200 stream"
        if problem:
            self._keep(f"{label}: {problem}: {content[:200]!r}")

    def no_answer(self, label: str, exc: Exception) -> None:
        self.num_cases += 1
        self.num_no_answer += 1
        self._keep(f"{label}: no answer: {type(exc).__name__}: {str(exc)[:200]}")

    def _keep(self, line: str) -> None:
        if len(self.offenders) < MAX_EXAMPLES_KEPT:
            self.offenders.append(line)

    @property
    def num_failed(self) -> int:
        return self.num_5xx + self.num_bad_4xx + self.num_stream_errors + self.num_no_answer

    def summary(self) -> str:
        statuses = dict(sorted(self.statuses.items()))
        return (
            f"{self.num_cases} cases {statuses}: {self.num_5xx} 5xx, {self.num_bad_4xx} 4xx "
            f"without an OpenAI body, {self.num_stream_errors} stream error events, "
            f"{self.num_no_answer} unanswered" + "".join(f"\n    {line}" for line in self.offenders)
        )


def run(context: DrillContext) -> DrillResult:
    from server_process import ServerProcess

    result = DrillResult("fuzz")
    budget = QUICK if context.quick else FULL
    server = ServerProcess(context.model_dir, *SERVE_ARGS, timeout_s=300)
    try:
        spec = httpx.get(f"{server.url}/openapi.json", timeout=TIMEOUT_S).json()
        tally = Tally()
        fuzz_with_schema(spec, server.url, {}, budget.examples, tally)
        result.figures["replica_schema_cases"] = tally.num_cases
        send_extremes(server.url, {}, tally)
        _record_tally(result, "replica", tally)
        healthy = not server.has_exited() and _is_healthy(server.url)
        result.figures["replica_crashes"] = int(not healthy)
        result.check("replica: survived the fuzzing (process up, engine healthy)", healthy,
                     "" if healthy else server.log_tail(8))  # fmt: skip
        if healthy:  # else the socket drills would only measure a dead replica
            slow_clients(result, server.url, MODEL, budget.num_slow_clients, budget.slow_s)
            silent_readers(result, server.url, server.pid, MODEL, budget.num_silent_readers)
            disconnects(result, "replica", server.url, server.url, MODEL, budget.num_disconnects)
            head_flood(result, "replica", server.url, "/health")
            token_id_flood(result, "replica", server.url, MODEL)
            odd_request_ids(result, "replica", server.url, MODEL)
            _check_answers(result, "replica", server.url, {})
    finally:
        server.stop()
    fuzz_gateway(result, context, spec, budget)
    return result


# Schemathesis -------------------------------------------------------------------------------
def fuzz_with_schema(
    spec: dict, url: str, headers: dict[str, str], max_examples: int, tally: Tally
) -> None:
    """Every operation of `spec`, positive and negative cases, sent to `url`."""
    import hypothesis
    import requests
    import schemathesis
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(spec)
    session = requests.Session()
    for operation in schema.get_all_operations():
        operation = operation.ok()
        for mode in GenerationMode:

            @hypothesis.seed(SEED)
            @hypothesis.settings(
                max_examples=max_examples,
                deadline=None,
                database=None,
                phases=[hypothesis.Phase.generate],
                suppress_health_check=list(hypothesis.HealthCheck),
                verbosity=hypothesis.Verbosity.quiet,
            )
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode), pin=st.booleans())
            def send(case, pin: bool) -> None:
                if pin and isinstance(case.body, dict):
                    case.body["model"] = MODEL
                label = f"{case.method} {case.path} {_short(case.body)}"
                try:
                    response = case.call(
                        base_url=url, session=session, headers=headers, timeout=TIMEOUT_S
                    )
                except requests.RequestException as exc:
                    tally.no_answer(label, exc)
                    return
                tally.record(label, response.status_code, response.content)

            # Unsatisfiable: no negative case exists for an operation without parameters.
            with contextlib.suppress(hypothesis.errors.Unsatisfiable):
                send()


# Hand-written extremes ----------------------------------------------------------------------
_HUGE_INTS = [2**63, 2**64, -(2**63) - 1, 10**30, -1, 0]
_ODD_NUMBERS = [math.nan, math.inf, -math.inf, -1.0, -0.0, 1e-300, 1e308, 2**70, 1.5, True, "1"]
_ODD_STRINGS = ["\ud800", "a\udfffb", "\x00", "\uffff", "e\u0301" * 2000, "🙂" * 50_000,
                "x" * (1 << 20), "\u202e" + "ab" * 100]  # fmt: skip


def extreme_cases(vocab_size: int) -> Iterator[tuple[str, str, bytes, str]]:
    """(label, path, body, content type) of requests no schema-driven generator aims at."""
    completion = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

    def case(label: str, path: str, body: object) -> tuple[str, str, bytes, str]:
        raw = body if isinstance(body, bytes) else _dumps(body)
        return label, path, raw, "application/json"

    for name in ("max_tokens", "n", "logprobs", "top_k", "seed", "min_tokens", "priority"):
        for value in _HUGE_INTS + _ODD_NUMBERS:
            body = completion | {name: value}
            yield case(f"completion {name}={value!r}", "/v1/completions", body)
    for value in _HUGE_INTS + _ODD_NUMBERS:
        body = chat | {"logprobs": True, "top_logprobs": value}
        yield case(f"chat top_logprobs={value!r}", "/v1/chat/completions", body)
        body = completion | {"stop_token_ids": [value]}
        yield case(f"stop_token_ids=[{value!r}]", "/v1/completions", body)
    floats = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty")  # fmt: skip
    for name in floats:
        for value in _ODD_NUMBERS:
            yield case(f"chat {name}={value!r}", "/v1/chat/completions", chat | {name: value})
    for prompt in ([vocab_size], [-1], [2**63], [2**64], [[]], [[1], []], [[1, 10**30]],
                   [0] * 100_000, [[0]] * 2000, [1.0], [True]):  # fmt: skip
        label = f"token ids {_short(prompt)}"
        yield case(label, "/v1/completions", completion | {"prompt": prompt, "max_tokens": 1})
    for text in _ODD_STRINGS:
        label = _short(text)
        yield case(f"prompt {label}", "/v1/completions", completion | {"prompt": text})
        yield case(f"prompt list {label}", "/v1/completions", completion | {"prompt": [text, text]})
        yield case(f"stop {label}", "/v1/completions", completion | {"stop": text})
        yield case(f"model {label}", "/v1/completions", completion | {"model": text})
        yield case(f"user {label}", "/v1/completions", completion | {"user": text})
        message = {"role": "user", "content": text, "name": text}
        yield case(f"content {label}", "/v1/chat/completions", chat | {"messages": [message]})
        parts = {"role": "user", "content": [{"type": "text", "text": text}]}
        yield case(f"parts {label}", "/v1/chat/completions", chat | {"messages": [parts]})
    logprobs = completion | {"prompt": [1, 2, 3], "echo": True, "logprobs": 20, "n": 16}
    yield case("echo with 20 logprobs, n=16", "/v1/completions", logprobs)
    yield case("echo streamed", "/v1/completions", logprobs | {"stream": True})
    streamed = chat | {"stream": True, "logprobs": True, "top_logprobs": 20, "n": 16}
    yield case("chat stream with logprobs, n=16", "/v1/chat/completions", streamed)
    for label, raw in _BAD_JSON:
        yield case(label, "/v1/completions", raw)
        yield case(label, "/v1/chat/completions", raw)
    utf16 = json.dumps(completion).encode("utf-16")
    yield "UTF-16 JSON", "/v1/completions", utf16, "application/json"
    form = "application/x-www-form-urlencoded"
    yield "form body", "/v1/completions", b"model=tiny&prompt=hi", form
    yield "text body", "/v1/completions", _dumps(completion), "text/plain"


_BAD_JSON = [
    ("empty body", b""),
    ("truncated", b'{"model": "tiny", "prompt": "hel'),
    ("non-UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe\xc3("}'),
    ("nested arrays", b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("nested objects", b'{"a": ' * 50_000 + b"1" + b"}" * 50_000),
    ("duplicated keys", b'{"model": "x", "model": "tiny", "prompt": "hi", "max_tokens": 2}'),
    ("5000-digit integer", b'{"model": "tiny", "max_tokens": ' + b"9" * 5000 + b"}"),
    ("1e99999", b'{"model": "tiny", "prompt": "hi", "max_tokens": 1e99999}'),
    ("null", b"null"),
    ("array", b"[]"),
    ("string", b'"tiny"'),
    ("trailing garbage", b'{"model": "tiny", "prompt": "hi"} xyz'),
    ("byte order mark", b'\xef\xbb\xbf{"model": "tiny", "prompt": "hi", "max_tokens": 2}'),
]


def send_extremes(url: str, headers: dict[str, str], tally: Tally) -> None:
    """The hand-written cases, plus unknown paths and methods."""
    with httpx.Client(base_url=url, headers=headers, timeout=TIMEOUT_S) as client:
        vocab_size = _vocab_size(client)
        requests = [(label, "POST", path, raw, {"content-type": kind})
                    for label, path, raw, kind in extreme_cases(vocab_size)]  # fmt: skip
        requests += [
            ("unknown path", "POST", "/v1/embeddings", b"{}", {}),
            ("unknown path", "GET", "/v2/models", b"", {}),
            ("wrong method", "GET", "/v1/completions", b"", {}),
            ("wrong method", "DELETE", "/v1/chat/completions", b"", {}),
            ("wrong method", "PUT", "/v1/models", b"{}", {}),
        ]
        for label, method, path, raw, extra in requests:
            try:
                response = client.request(method, path, content=raw, headers=extra)
            except httpx.HTTPError as exc:
                tally.no_answer(label, exc)
                continue
            tally.record(f"{method} {path} {label}", response.status_code, response.content)


# The gateway --------------------------------------------------------------------------------
def fuzz_gateway(result: DrillResult, context: DrillContext, spec: dict, budget: Budget) -> None:
    from modelship.gateway import hash_api_key
    from modelship.storage import Storage

    from fleet_process import UpProcess
    from fleet_storage import publish_release

    storage = Storage(context.work_dir / "storage")
    storage.set_production(MODEL, publish_release(storage, MODEL, context.model_dir, "fp16"))
    config = {
        "serve": {"engine": {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_mb": 16}},
        "gateway": {"tenants": [{"name": "fuzz", "api_key_sha256": hash_api_key(KEY)}]},
        "autoscale": {"min_replicas": 1, "max_replicas": 1},
    }
    up = UpProcess(config, storage.root, MODEL, context.work_dir)
    headers = {"authorization": f"Bearer {KEY}"}
    try:
        up.wait_ready(300)
        (replica,) = up.replicas()
        replica_url = up.replica_url(replica)
        tally = Tally()
        fuzz_with_schema(spec, up.url, headers, budget.gateway_examples, tally)
        result.figures["gateway_schema"] = "the replica's (the gateway serves none)"
        result.figures["gateway_schema_cases"] = tally.num_cases
        send_extremes(up.url, headers, tally)
        _record_tally(result, "gateway", tally)
        restarts = up.metric("modelship_gateway_replica_restarts_total")
        healthy = up.process.poll() is None and restarts == 0 and _is_healthy(replica_url)
        result.figures["gateway_replica_restarts"] = int(restarts)
        result.check(
            "gateway: it and its replica survived the fuzzing", healthy,
            f"replica restarts {restarts:.0f}; logs: {context.work_dir}",
        )  # fmt: skip
        if healthy:
            count = budget.gateway_disconnects
            disconnects(result, "gateway", up.url, replica_url, MODEL, count, headers)
            head_flood(result, "gateway", up.url, "/v1/models")
            token_id_flood(result, "gateway", up.url, MODEL, headers)
            odd_request_ids(result, "gateway", up.url, MODEL, headers)
            _check_answers(result, "gateway", up.url, headers)
    finally:
        up.stop()


# Helpers ------------------------------------------------------------------------------------
def _record_tally(result: DrillResult, name: str, tally: Tally) -> None:
    result.figures[f"{name}_cases"] = tally.num_cases
    result.figures[f"{name}_5xx"] = tally.num_5xx
    result.figures[f"{name}_non_openai_4xx"] = tally.num_bad_4xx
    result.figures[f"{name}_stream_errors"] = tally.num_stream_errors
    result.figures[f"{name}_unanswered"] = tally.num_no_answer
    result.check(
        f"{name}: no 5xx, every 4xx an OpenAI error, every request answered",
        tally.num_cases > 0 and tally.num_failed == 0,
        tally.summary(),
    )


def _check_answers(result: DrillResult, name: str, url: str, headers: dict[str, str]) -> None:
    result.check(f"{name}: answering afterwards", answers(url, MODEL, headers))


def _is_healthy(url: str) -> bool:
    """/health: 503 once the engine died or stalled, though the process still runs."""
    try:
        return httpx.get(f"{url}/health", timeout=TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


def _vocab_size(client: httpx.Client) -> int:
    """The first token id past the vocabulary, found from the server's own 400."""
    body = {"model": MODEL, "prompt": [2**31], "max_tokens": 1}
    message = client.post("/v1/completions", json=body).json()["error"]["message"]
    return int(message.rsplit(", ", 1)[1].rstrip(")"))


def _dumps(body: object) -> bytes:
    # NaN and Infinity as Python writes them (not strict JSON): clients do send them.
    return json.dumps(body).encode()


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:50]}...({len(text)} chars)"


def _has_error_event(content: bytes) -> bool:
    for line in content.splitlines():
        if line.startswith(b"data: {") and b'"error"' in line:
            try:
                if "error" in json.loads(line[6:]):
                    return True
            except ValueError:
                return True
    return False
