"""The pure parts of failover and forwarding: what a stream delivered, and the replica's
body built from the client's bytes."""

from __future__ import annotations

import json

from modelship.gateway.config import RequestLimitsConfig
from modelship.gateway.failover import StreamProgress
from modelship.gateway.request import parse_request


def _event(chunk_id: str, ids: list[int], finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": "x", "finish_reason": finish, "token_ids": ids}
    return f"data: {json.dumps({'id': chunk_id, 'choices': [choice]})}\n\n".encode()


def test_progress_keeps_token_ids_and_one_chunk_id_across_a_resume():
    progress = StreamProgress(pass_token_ids=True)
    first = _event("cmpl-a", [1, 2]) + _event("cmpl-a", [3])
    assert progress.read(first) == first  # untouched before any failover
    progress.resume()
    passed = progress.read(_event("cmpl-b", [4], "length") + b"data: [DONE]\n\n")
    assert passed == _event("cmpl-a", [4], "length") + b"data: [DONE]\n\n"
    assert progress.token_ids == [1, 2, 3, 4] and progress.is_finished


def test_token_ids_the_gateway_asked_for_are_taken_out_of_the_clients_events():
    """Every failover-eligible stream carried them to clients that never asked."""
    progress = StreamProgress()
    passed = progress.read(_event("cmpl-a", [1, 2]) + b"data: [DONE]\n\n")
    first, done = passed.split(b"\n\n", 1)
    assert json.loads(first[6:])["choices"] == [{"index": 0, "text": "x", "finish_reason": None}]
    assert done == b"data: [DONE]\n\n"
    progress.resume()
    resumed = json.loads(progress.read(_event("cmpl-b", [3], "length"))[6:])
    assert resumed["id"] == "cmpl-a" and "token_ids" not in resumed["choices"][0]
    assert progress.token_ids == [1, 2, 3]  # still read for the next resume


def test_the_replica_body_is_the_clients_bytes_plus_what_the_gateway_set():
    raw = b'{"model": "m", "prompt": "hi", "priority": 9}\n'
    parsed = parse_request(raw, "/v1/completions", None, RequestLimitsConfig())
    assert parsed.encode() == raw  # nothing changed: sent as it came
    parsed.set("priority", 1)
    body = parsed.encode(resume_token_ids=[5])
    assert body.startswith(raw.rstrip()[:-1])
    assert json.loads(body) == {"model": "m", "prompt": "hi", "priority": 1,
                                "resume_token_ids": [5]}  # fmt: skip
    utf16 = parse_request('{"model":"m","prompt":"x"}'.encode("utf-16"), "/v1/completions",
                          None, RequestLimitsConfig())  # fmt: skip
    utf16.set("priority", 1)
    assert json.loads(utf16.encode()) == {"model": "m", "prompt": "x", "priority": 1}
