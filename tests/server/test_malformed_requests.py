"""Requests the fuzz drill (benchmarks/drill/fuzz.py) found answered with a 500 or a
non-OpenAI body, answered in-process: each is refused before any engine would see it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from modelship.engine.outputs import EngineStats
from modelship.engine.tokenizer import Tokenizer
from modelship.server.app import create_app
from modelship.server.limits import RequestLimitsConfig

MODEL = "tiny"


class RefusingEngine:
    """Stands in for the engine: every request of these tests is refused before it."""

    is_dead = False
    max_model_len = 256

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def stats(self) -> EngineStats:
        raise AssertionError("no metrics in these tests")

    async def add_request(self, *args, **kwargs):
        raise AssertionError("a malformed request reached the engine")


@pytest.fixture(scope="module")
def client(tiny_llama_dir: Path) -> TestClient:
    engine = RefusingEngine(Tokenizer.from_folder(tiny_llama_dir))
    # Not entered as a context manager: no lifespan, so no warm-up request.
    return TestClient(create_app(engine, MODEL), raise_server_exceptions=False)


def post(client: TestClient, path: str, raw: str | bytes):
    return client.post(path, content=raw, headers={"content-type": "application/json"})


def assert_openai_error(response, status: int, fragment: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"], error
    return error


COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("path", "fields", "where"),
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {"prompt": ["fine", "\udfff"]}, "prompt.1"),
        ("/v1/completions", {"model": "\ud800"}, "model"),
        ("/v1/completions", {"stop": ["\ud800"]}, "stop.0"),
        ("/v1/completions", {"user": "\ud800"}, "user"),
        ("/v1/completions", {"metadata": {"\ud800": 1}}, "metadata.\\ud800"),  # escaped
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
         "messages.0.content"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
         "messages.0.content.0.text"),
    ],
)  # fmt: skip
def test_lone_surrogates_are_400_naming_where(client, path, fields, where) -> None:
    """JSON can escape a lone surrogate and Python parses it; the tokenizer (TypeError) and
    the UTF-8 encoding of an error that echoed it (the model name) answered 500."""
    body = (CHAT if "chat" in path else COMPLETION) | fields
    response = post(client, path, json.dumps(body))  # ASCII: the escapes stay escapes
    assert_openai_error(response, 400, f"{where}: must be valid Unicode")


def test_surrogate_pairs_are_text(client) -> None:
    """A pair escaped as two halves is one character, not a lone surrogate: it goes on to
    the usual checks (here the model name: 404)."""
    raw = json.dumps(COMPLETION | {"prompt": "🙂", "model": "other"})
    assert "\\ud83d\\ude42" in raw
    response = post(client, "/v1/completions", raw)
    assert_openai_error(response, 404, "does not exist")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny", "prompt": "\xff\xfe"}',  # not UTF-8
        b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # too deep
        b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # > 4300 digits
    ],
    ids=["non-utf8", "nested", "5000-digit-integer"],
)
def test_bodies_the_json_decoder_refuses_are_openai_400s(client, raw: bytes) -> None:
    """FastAPI answers these {"detail": "There was an error parsing the body"}."""
    response = post(client, "/v1/completions", raw)
    error = assert_openai_error(response, 400, "parse the JSON")
    assert error["type"] == "invalid_request_error"


def test_unknown_paths_and_methods_are_openai_errors(client) -> None:
    """Starlette's router answered {"detail": "Not Found"} / {"detail": "Method Not Allowed"}."""
    error = assert_openai_error(client.post("/v1/audio/speech", json={}), 404, "/v1/audio/speech")
    assert error["code"] == "not_found"
    response = client.get("/v1/completions")
    error = assert_openai_error(response, 405, "GET is not allowed")
    assert error["code"] == "method_not_allowed"
    assert response.headers["allow"] == "POST"


def test_more_prompts_than_an_idle_replica_could_ever_queue_is_a_400(client) -> None:
    """2000 prompts (each an engine request) overflowed the waiting queue: a 429 with
    Retry-After that no retry could ever pass. 64 prompts of n = 16 fill it exactly."""
    body = COMPLETION | {"prompt": [[1]] * 65}
    error = assert_openai_error(post(client, "/v1/completions", json.dumps(body)), 400, "64")
    assert error["param"] == "prompt"
    body = COMPLETION | {"prompt": list(range(100)), "model": "other"}  # token ids: one prompt
    assert_openai_error(post(client, "/v1/completions", json.dumps(body)), 404, "other")


@pytest.mark.parametrize("value", [1e-300, 1e-3, 0.0, -0.0, 1e3, 1e308])
def test_repetition_penalties_that_overflow_logits_are_400s(client, value: float) -> None:
    """1e-300 divided every seen positive logit to +inf: the sampler took the replica's
    model for broken and stopped its engine (one request took a replica down). 0 was
    silently served as 1."""
    body = CHAT | {"repetition_penalty": value}
    response = post(client, "/v1/chat/completions", json.dumps(body))
    error = assert_openai_error(response, 400, "repetition_penalty must be in [0.01, 100.0]")
    assert error["param"] == "repetition_penalty"


def test_a_body_over_the_cap_is_an_openai_413(tiny_llama_dir: Path) -> None:
    """`serve --max-body-mb`: a declared or a chunked body past it is refused unread."""
    engine = RefusingEngine(Tokenizer.from_folder(tiny_llama_dir))
    limited = TestClient(create_app(engine, MODEL, limits=RequestLimitsConfig(max_body_mb=1)),
                         raise_server_exceptions=False)  # fmt: skip

    def chunks():
        for _ in range(48):
            yield b" " * 2**16

    for content in (b" " * (2**20 + 1), chunks()):
        response = limited.post("/v1/completions", content=content,
                                headers={"content-type": "application/json"})  # fmt: skip
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
