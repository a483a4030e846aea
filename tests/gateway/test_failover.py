"""Mid-stream failover through `modelship up`: a replica killed (-9) in the middle of a
stream, the client's stream goes on from the other replica and equals an uninterrupted
greedy run; with no replica left to resume it, the stream ends with an error event."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from modelship.engine.faults import FAULTS_ENV
from modelship.storage import Storage

from fleet_process import UpProcess
from fleet_storage import publish_release

SLUG = "tiny"
KILL_SEED, KILL_AFTER = 7, 8  # a request with this seed kills its replica at its 8th token
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    workdir = tmp_path_factory.mktemp("failover")
    storage = Storage(workdir / "storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, tiny_llama_dir, "fp16"))
    config = {
        "serve": {"engine": {"max_model_len": 128, "kv_cache_memory_mb": 8}},
        "gateway": {
            "routing": {"policy": "round_robin"},
            "resilience": {"max_failovers": 1, "breaker_failure_threshold": 5},
        },
        "autoscale": {"min_replicas": 2, "max_replicas": 2, "restart_backoff_s": 0.2},
    }
    env = {FAULTS_ENV: f"kill={KILL_SEED}/{KILL_AFTER}"}
    up = UpProcess(config, storage.root, SLUG, workdir, env=env)
    try:
        up.wait_ready()
        _wait_two_ready(up)
        yield up
    finally:
        up.stop()


def _wait_two_ready(up: UpProcess) -> None:
    """Two live replica processes, both ready. The gauge alone is not enough: a replica the
    last test killed counts as ready until the supervisor's next tick notices it."""
    up.wait_for(
        lambda: (
            len(up.replicas()) == 2 and up.metric("modelship_gateway_replicas", state="ready") == 2
        ),
        timeout_s=120,
        what="two ready replicas",
    )


def _client(up: UpProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{up.url}/v1", api_key="none", max_retries=0, timeout=60)


def _chat(up: UpProcess, max_tokens: int, **kwargs) -> tuple[str, openai.types.CompletionUsage]:
    stream = _client(up).chat.completions.create(
        model=SLUG,
        messages=[{"role": "user", "content": "The quick brown fox"}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        **kwargs,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len({c.id for c in chunks}) == 1  # one stream, whichever replica served it
    return text, chunks[-1].usage


def test_chat_stream_survives_a_killed_replica(fleet: UpProcess):
    resumed_before = fleet.metric("modelship_gateway_failovers_total", outcome="resumed")
    expected, expected_usage = _chat(fleet, KILL_AFTER)
    text, usage = _chat(fleet, KILL_AFTER, seed=KILL_SEED)  # its first replica dies
    assert text == expected
    assert usage == expected_usage  # counted as one uninterrupted stream
    after = fleet.metric("modelship_gateway_failovers_total", outcome="resumed")
    assert after == resumed_before + 1


def test_a_responses_stream_survives_a_killed_replica(fleet: UpProcess):
    """/v1/responses is a chat completion inside the gateway: its stream resumes too, and
    the client sees one Responses event sequence."""
    _wait_two_ready(fleet)
    expected, expected_usage = _chat(fleet, KILL_AFTER)
    resumed_before = fleet.metric("modelship_gateway_failovers_total", outcome="resumed")
    whole = _client(fleet).responses.create(
        model=SLUG, input="The quick brown fox", max_output_tokens=KILL_AFTER, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert whole.output_text == expected
    events = list(
        _client(fleet).responses.create(
            model=SLUG,
            input="The quick brown fox",
            max_output_tokens=KILL_AFTER,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "seed": KILL_SEED},
        )
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert events[-1].response.usage.output_tokens == expected_usage.completion_tokens
    after = fleet.metric("modelship_gateway_failovers_total", outcome="resumed")
    assert after == resumed_before + 1


def test_a_resumed_streams_first_byte_is_the_first_replicas(fleet: UpProcess):
    """TTFB of a stream that failed over is when the first replica answered, which the
    client saw before the cut; not when the second replica took over, after it."""
    _wait_two_ready(fleet)
    name = "modelship_gateway_time_to_first_byte_seconds"
    before = fleet.metric(f"{name}_sum"), fleet.metric(f"{name}_count")
    started = time.perf_counter()
    stream = _client(fleet).chat.completions.create(
        model=SLUG, messages=[{"role": "user", "content": "The quick brown fox"}],
        max_tokens=KILL_AFTER + 2, temperature=0, stream=True, seed=KILL_SEED,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    seen_by_client = None
    for _chunk in stream:
        if seen_by_client is None:
            seen_by_client = time.perf_counter() - started
    after = fleet.metric(f"{name}_sum"), fleet.metric(f"{name}_count")
    assert after[1] == before[1] + 1
    assert seen_by_client is not None and after[0] - before[0] <= seen_by_client


def test_completion_stream_survives_a_killed_replica(fleet: UpProcess):
    _wait_two_ready(fleet)
    prompt = "Paged attention reads keys"

    def complete(**kwargs) -> str:
        stream = _client(fleet).completions.create(
            model=SLUG, prompt=prompt, max_tokens=KILL_AFTER, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, **kwargs,
        )  # fmt: skip
        return "".join(c.choices[0].text for c in stream if c.choices)

    assert complete(seed=KILL_SEED) == complete()


def test_token_ids_the_gateway_asked_for_never_reach_the_client(fleet: UpProcess):
    """The gateway asks every failover-eligible stream's replica for its token ids (to
    resume it elsewhere); they went on to every client. A client may not ask for them
    itself: `return_token_ids` is the failover's field (a 400 naming it)."""
    _wait_two_ready(fleet)
    body = {"model": SLUG, "prompt": "Paged attention", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{fleet.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    carried = [("token_ids" in c) for e in events for c in e["choices"]]
    assert carried and not any(carried), events
    asked = httpx.post(f"{fleet.url}/v1/completions", json=body | {"return_token_ids": True},
                       timeout=60)  # fmt: skip
    assert asked.status_code == 400 and asked.json()["error"]["param"] == "return_token_ids"


def test_stream_ends_with_an_error_event_when_no_replica_can_resume(fleet: UpProcess):
    """Both replicas die (the resumed request reaches the kill again): with one failover
    allowed, the client gets an error event, not a silently cut stream."""
    _wait_two_ready(fleet)
    before = fleet.metric("modelship_gateway_failovers_total", outcome="exhausted")
    with pytest.raises(openai.APIError, match="no other replica could resume"):
        _chat(fleet, 3 * KILL_AFTER, seed=KILL_SEED)
    assert fleet.metric("modelship_gateway_failovers_total", outcome="exhausted") == before + 1
