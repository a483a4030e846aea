"""Reading the replica's usage from answers and streams (what tenants are charged)."""

from __future__ import annotations

import json

from modelship.gateway.usage import StreamUsage, Usage, ask_for_usage, usage_from_body


def event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


TOKEN = event({"choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": None})
USAGE = event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
DONE = event("[DONE]")


def test_the_usage_event_is_read_and_dropped_unless_the_client_asked():
    stream = TOKEN * 3 + USAGE + DONE
    for pass_usage_event in (False, True):
        usage = StreamUsage(pass_usage_event)
        # Split everywhere, even inside events: only whole events come out.
        passed = b"".join(usage.feed(stream[i : i + 5]) for i in range(0, len(stream), 5))
        passed += usage.flush()
        assert passed == (stream if pass_usage_event else TOKEN * 3 + DONE)
        assert usage.usage == Usage(prompt_tokens=7, completion_tokens=3)
        assert usage.num_events == 3


def test_a_cut_stream_counts_its_events():
    usage = StreamUsage(pass_usage_event=False)
    assert usage.feed(TOKEN * 2 + TOKEN[:10]) == TOKEN * 2
    assert usage.usage is None and usage.num_events == 2


def test_usage_from_a_body_and_asking_for_it():
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    assert usage_from_body(body.encode()) == Usage(5, 2)
    assert usage_from_body(b"not json") is None
    assert usage_from_body(b'{"usage": {"prompt_tokens": "5"}}') is None
    request: dict = {"stream": True}
    assert not ask_for_usage(request)
    assert request["stream_options"] == {"include_usage": True}
    request = {"stream": True, "stream_options": {"include_usage": True}}
    assert ask_for_usage(request)


def test_the_first_token_is_the_first_event_with_text():
    role = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    usage = StreamUsage(pass_usage_event=False)
    usage.feed(role)
    assert usage.first_token_at is None  # a role-only chunk is not a token
    usage.feed(TOKEN)
    first = usage.first_token_at
    assert first is not None
    usage.feed(TOKEN)
    assert usage.first_token_at == first
    completion = StreamUsage(pass_usage_event=False)
    completion.feed(event({"choices": [{"index": 0, "text": ""}]}))
    assert completion.first_token_at is None
    completion.feed(event({"choices": [{"index": 0, "text": "x"}]}))
    assert completion.first_token_at is not None
