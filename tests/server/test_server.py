"""The OpenAI-compatible server as a real process, driven by the official `openai` SDK."""

from __future__ import annotations

import json
import math
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from server_process import ServerProcess

API_KEY = "sk-test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tiny_llama_dir,
        "--served-model-name",
        MODEL,
        "--api-key",
        API_KEY,
        "--max-model-len",
        "256",
        "--max-waiting-requests",
        "4",
        # 8 running + 4 waiting: test_overload's 24 requests overflow whatever their timing
        "--max-num-seqs",
        "8",
        "--kv-cache-memory-mb",
        "16",
        "--max-n",
        "8",
        "--max-stop",
        "4",
        "--max-stop-chars",
        "32",
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def raw(
    server: ServerProcess, path: str, body: object, key: str | None = API_KEY
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, str) else json.dumps(body)
    headers["Content-Type"] = "application/json"
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    text = httpx.get(f"{server.url}/metrics").text
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if all(label in line for label in wanted):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion_and_usage(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Say hello"}]},
        ],
        max_tokens=8,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.completion_tokens <= 8
    assert response.usage.total_tokens == (
        response.usage.prompt_tokens + response.usage.completion_tokens
    )
    assert response.usage.prompt_tokens > 5


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]

    chat_kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0
    )
    chat_whole = client.chat.completions.create(**chat_kwargs)
    stream = list(client.chat.completions.create(**chat_kwargs, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in stream)
    assert streamed == chat_whole.choices[0].message.content


def test_n_stop_seed_and_logprobs(client: openai.OpenAI) -> None:
    many = client.completions.create(
        model=MODEL, prompt="Paged attention", max_tokens=6, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    again = client.completions.create(
        model=MODEL, prompt="Paged attention", max_tokens=6, n=3, temperature=1.0, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in many.choices]

    greedy = client.completions.create(model=MODEL, prompt="Models", max_tokens=12, temperature=0)
    text = greedy.choices[0].text
    if len(text) > 4:
        stop = text[2:4]
        stopped = client.completions.create(
            model=MODEL, prompt="Models", max_tokens=12, temperature=0, stop=[stop]
        )
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == text[: text.index(stop)]

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-4  # greedy took the top one

    legacy = client.completions.create(
        model=MODEL, prompt=[1, 2, 3, 4], max_tokens=3, temperature=0, logprobs=2
    )
    assert len(legacy.choices[0].logprobs.token_logprobs) == legacy.usage.completion_tokens
    assert legacy.usage.prompt_tokens == 4


def test_echo_logprobs_score_the_prompt_like_lm_eval(
    client: openai.OpenAI, tiny_llama_dir: Path
) -> None:
    """lm-eval's loglikelihood request: echo the prompt with logprobs, read the prompt's."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = [5, 17, 99, 3, 42, 8, 77]
    kwargs = dict(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**kwargs)
    logprobs = whole.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(ids) + 1  # the prompt, then one generated
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    for position in range(1, len(ids)):
        reference = expected[position - 1, ids[position]].item()
        # the server computes in bfloat16 on CPU
        assert logprobs.token_logprobs[position] == pytest.approx(reference, abs=2e-2)
        assert len(logprobs.top_logprobs[position]) == 1

    chunks = list(client.completions.create(**kwargs, stream=True))
    streamed = [
        value
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for value in chunk.choices[0].logprobs.token_logprobs
    ]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-5)


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ("{not json", 400, "parse the JSON"),
        ({"model": MODEL, "messages": []}, 400, "at least one message"),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 1000}, 400, "maximum context length is 256"),
        ({"model": "other", "prompt": "x"}, 404, "does not exist"),
        ({"model": MODEL}, 400, "prompt"),
    ],
)
def test_errors_are_openai_bodies(server, body, status, fragment) -> None:
    path = (
        "/v1/chat/completions"
        if isinstance(body, dict) and "messages" in body
        else ("/v1/completions")
    )
    response = raw(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"top_k": 2**63}, "top_k"),
        ("/v1/completions", {"top_k": 10**6}, "top_k"),  # beyond the vocab
        ("/v1/completions", {"seed": 2**64, "n": 2}, "seed"),
        ("/v1/completions", {"seed": -(2**63) - 1}, "seed"),
        ("/v1/completions", {"temperature": math.nan}, "temperature"),
        ("/v1/completions", {"temperature": math.inf}, "temperature"),
        ("/v1/completions", {"top_p": math.inf}, "top_p"),
        ("/v1/completions", {"repetition_penalty": math.inf}, "repetition_penalty"),
        ("/v1/completions", {"presence_penalty": math.nan}, "presence_penalty"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"frequency_penalty": -math.inf}, "frequency_penalty"),
    ],
)
def test_out_of_range_params_are_400_naming_the_param(
    server: ServerProcess, client: openai.OpenAI, path: str, fields: dict, param: str
) -> None:
    """Checked before the request is queued: never a 500, never a failed engine step."""
    body: dict = {"model": MODEL, "max_tokens": 4, "temperature": 1.0, **fields}
    if path == "/v1/completions":
        body["prompt"] = "Paged attention"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    response = raw(server, path, json.dumps(body))  # NaN and Infinity as Python's json writes
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    after = client.completions.create(model=MODEL, prompt="still fine", max_tokens=2)
    assert after.choices[0].finish_reason in ("stop", "length")
    assert metric(server, "modelship:num_requests_waiting") == 0


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"n": 9}, "n", "at most 8"),  # --max-n 8
        ({"n": 5}, "n", "at most 4"),  # the waiting limit (4) could never admit 5 sequences
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),  # --max-stop 4
        ({"stop": "x" * 33}, "stop", "at most 32 characters"),  # --max-stop-chars 32
        ({"stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids", "at most 4"),
    ],
)
def test_n_and_stop_beyond_the_caps_are_400(
    server: ServerProcess, fields: dict, param: str, fragment: str
) -> None:
    for path, extra in [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        response = raw(server, path, {"model": MODEL, "max_tokens": 2, **extra, **fields})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and fragment in error["message"]


def test_n_and_stop_at_the_caps_are_served(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL,
        prompt="Paged attention",
        max_tokens=2,
        n=4,
        stop=["a" * 32, "b", "c", "d"],
        extra_body={"stop_token_ids": [1, 2, 3, 4]},
    )
    assert sorted(choice.index for choice in response.choices) == [0, 1, 2, 3]


def test_missing_or_wrong_key_is_401(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert raw(server, "/v1/completions", body, key=None).status_code == 401
    wrong = raw(server, "/v1/completions", body, key="sk-wrong")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


def test_overload_is_429_with_retry_after(server: ServerProcess, client: openai.OpenAI) -> None:
    results: list[int] = []

    def one() -> None:
        body = {"model": MODEL, "prompt": "load " * 20, "max_tokens": 64, "ignore_eos": True}
        results.append(raw(server, "/v1/completions", body).status_code)

    threads = [threading.Thread(target=one) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 429 in results and 200 in results
    assert set(results) <= {200, 429}


def test_disconnect_aborts_and_frees_blocks(server: ServerProcess) -> None:
    before_usage = metric(server, "modelship:kv_cache_usage_perc")
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": "abort me",
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
        },
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # got the first chunk, then hang up
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        aborted = metric(server, "modelship:request_success_total", finished_reason="abort")
        if metric(server, "modelship:num_requests_running") == 0 and aborted >= 1:
            break
        time.sleep(0.1)
    assert metric(server, "modelship:request_success_total", finished_reason="abort") >= 1
    assert metric(server, "modelship:num_requests_running") == 0
    assert metric(server, "modelship:kv_cache_usage_perc") <= before_usage


def test_clients_hanging_up_during_admission_leave_the_replica_serving(
    tiny_llama_dir: Path,
) -> None:
    """Clients that send a request and hang up while it waits for the engine thread (busy
    with long prefill steps): the server cancels the handler mid-admission, and the engine
    thread must survive that race (it used to die, hanging every later request while
    /ready and /health still said 200)."""
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--max-num-batched-tokens", "8192"
    )
    rng = random.Random(0)

    def send_and_hang_up() -> None:
        prompt = [rng.randrange(3, 300) for _ in range(500)]  # distinct: no prefix hits
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True})
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection((process.host, process.port), timeout=10) as sock:
            sock.sendall(head.encode() + body.encode())
            time.sleep(0.03)  # long enough for the handler to start, then hang up

    try:
        threads = []
        for _ in range(48):  # staggered, so that requests arrive during long steps
            threads.append(threading.Thread(target=send_and_hang_up))
            threads[-1].start()
            time.sleep(0.015)
        for t in threads:
            t.join()
        client = openai.OpenAI(
            base_url=f"{process.url}/v1", api_key="none", max_retries=0, timeout=60
        )
        after = client.completions.create(
            model=MODEL, prompt="still serving", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert after.usage.completion_tokens == 3
        assert httpx.get(f"{process.url}/ready").status_code == 200
        assert httpx.get(f"{process.url}/health").status_code == 200
        assert "InvalidStateError" not in process.log()
    finally:
        process.stop()


def test_a_failed_prompt_of_a_batch_aborts_the_other_prompts(server: ServerProcess) -> None:
    """Prompts of one /v1/completions request run concurrently; when one fails (here the
    waiting limit of 4 cannot admit a second prompt of n=4 while the first waits), the
    others are aborted instead of generating to the end for nobody."""
    length_before = metric(server, "modelship:request_success_total", finished_reason="length")
    abort_before = metric(server, "modelship:request_success_total", finished_reason="abort")
    body = {
        "model": MODEL,
        "prompt": [f"batch prompt {i}" for i in range(6)],
        "n": 4,
        "max_tokens": 200,
        "ignore_eos": True,
    }
    response = raw(server, "/v1/completions", body)
    assert response.status_code == 429, response.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        idle = metric(server, "modelship:num_requests_running") == 0
        if idle and metric(server, "modelship:num_requests_waiting") == 0:
            break
        time.sleep(0.1)
    assert metric(server, "modelship:num_requests_running") == 0
    assert metric(server, "modelship:num_requests_waiting") == 0
    # The admitted prompt(s) ended as aborts, none ran to max_tokens.
    assert metric(server, "modelship:request_success_total", finished_reason="abort") >= (
        abort_before + 4
    )
    length_after = metric(server, "modelship:request_success_total", finished_reason="length")
    assert length_after == length_before


def test_metrics_move_after_requests(server: ServerProcess, client: openai.OpenAI) -> None:
    before = metric(server, "modelship:generation_tokens_total")
    prompt_before = metric(server, "modelship:prompt_tokens_total")
    client.completions.create(
        model=MODEL, prompt="count me", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert metric(server, "modelship:generation_tokens_total") == before + 5
    assert metric(server, "modelship:prompt_tokens_total") > prompt_before
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "prefix_cache_queries_total",
        "num_preemptions_total",
    ):
        assert f"modelship:{name}" in text
    assert 'model_name="tiny"' in text and 'variant="base"' in text


def test_drain_finishes_inflight_then_exits_0(tiny_llama_dir: Path) -> None:
    process = ServerProcess(tiny_llama_dir, "--served-model-name", MODEL, "--grace-period", "30")
    client = openai.OpenAI(base_url=f"{process.url}/v1", api_key="none", max_retries=0)
    result: dict = {}

    def long_request() -> None:
        result["response"] = client.completions.create(
            model=MODEL,
            prompt="drain",
            max_tokens=150,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.5)
    process.terminate()
    deadline = time.monotonic() + 5
    ready_status = None
    while time.monotonic() < deadline and worker.is_alive():
        try:
            ready_status = httpx.get(f"{process.url}/ready", timeout=1).status_code
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    worker.join(timeout=60)
    assert process.process.wait(timeout=60) == 0
    assert result["response"].usage.completion_tokens == 150
    if ready_status is not None:
        assert ready_status == 503
