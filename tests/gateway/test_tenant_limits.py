"""What tenants' caps and quotas guarantee, end to end: `modelship gateway` with tenants in
front of one `modelship serve` replica holding a key (as Kubernetes runs them).

- the failover's body fields are the gateway's alone: a client sending them is refused,
  and a replica without a key takes them from nobody;
- `max_input_tokens` holds on the real token count (the replica checks it), however many
  tokens a character makes;
- tokens per minute reserve each request's output bound, so concurrent requests cannot
  spend past the budget;
- a chat template refusing the messages is the client's 400, never a replica fault;
- tenants are refused replicas without a key (they would share one prefix cache), and
  behind vLLM the namespace is its own `cache_salt` body field.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from gateway_process import GatewayProcess
from modelship.gateway import hash_api_key
from vllm_stand_in import VllmStandIn

from server_process import ServerProcess

MODEL = "tiny"
REPLICA_KEY = "sk-replica-limits"
CAPPED, METERED, OPEN = "sk-capped-tenant", "sk-metered-tenant", "sk-open-tenant"
# Llama-2's rule: roles alternate user/assistant, else `raise_exception`.
ALTERNATING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("alternating") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "chat_template.jinja").write_text(ALTERNATING_TEMPLATE)
    return folder


def serve(model_dir: Path, api_key: str | None) -> ServerProcess:
    return ServerProcess(
        model_dir, "--served-model-name", MODEL, "--max-model-len", "2048",
        "--kv-cache-memory-mb", "32", api_key=api_key, timeout_s=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def replica(model_dir: Path) -> Iterator[ServerProcess]:
    process = serve(model_dir, REPLICA_KEY)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def gateway(replica: ServerProcess, tmp_path_factory: pytest.TempPathFactory):
    tenants = [
        {"name": "capped", "api_key_sha256": hash_api_key(CAPPED), "max_input_tokens": 200},
        {"name": "metered", "api_key_sha256": hash_api_key(METERED), "tokens_per_minute": 300},
        {"name": "open", "api_key_sha256": hash_api_key(OPEN)},
    ]
    resilience = {"breaker_failure_threshold": 3}
    process = GatewayProcess(
        tmp_path_factory.mktemp("gateway"), {"tenants": tenants, "resilience": resilience},
        "--endpoint", replica.url, api_key=REPLICA_KEY,
    )  # fmt: skip
    process.wait_ready(60)
    yield process
    assert process.stop() == 0, process.log_tail()


def client(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=60)


def post(url: str, body: dict, key: str | None, path: str = "/v1/completions") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


# Item: the failover's fields ----------------------------------------------------------------
def test_a_client_may_not_send_the_failovers_fields(gateway: GatewayProcess) -> None:
    # 1,000 raw ids, special ones included, would pass as output "already generated".
    for name, value in [("resume_token_ids", [1, 2] * 500), ("return_token_ids", True)]:
        with pytest.raises(openai.BadRequestError) as refused:
            client(gateway, CAPPED).completions.create(
                model=MODEL, prompt="Hi", max_tokens=8, stream=True, extra_body={name: value}
            )
        error = refused.value.body
        assert refused.value.status_code == 400 and error["param"] == name
        assert name in error["message"]


def test_a_replica_without_a_key_takes_the_fields_from_nobody(model_dir: Path) -> None:
    keyless = serve(model_dir, api_key=None)
    try:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 8, "stream": True}
        for name, value in [("resume_token_ids", [1, 2, 3]), ("return_token_ids", True)]:
            refused = post(keyless.url, {**body, name: value}, key=None)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == name
            assert "serve.api_key" in refused.json()["error"]["message"]
        # Nor does it take the gateway's input cap from anyone (ignored, like the salt).
        headers = {"x-modelship-max-input-tokens": "1"}
        answer = httpx.post(f"{keyless.url}/v1/completions", json={**body, "stream": False},
                            headers=headers, timeout=60)  # fmt: skip
        assert answer.status_code == 200, answer.text
    finally:
        keyless.stop()


def test_the_replica_takes_the_fields_with_its_key(replica: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}, "resume_token_ids": [5, 6, 7],
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{replica.url}/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {REPLICA_KEY}"}) as stream:  # fmt: skip
        assert stream.status_code == 200
        text = stream.read().decode()
    assert '"completion_tokens":8' in text.replace(" ", "")  # the 3 resumed count


# Item: max_input_tokens on the real count ---------------------------------------------------
def test_max_input_tokens_holds_on_the_replicas_count(gateway: GatewayProcess) -> None:
    capped = client(gateway, CAPPED)
    # 100 CJK characters: 300 tokens here (25 by characters / 4, which passed a cap of 200).
    messages = [{"role": "user", "content": "漢字" * 50}]
    with pytest.raises(openai.BadRequestError) as refused:
        capped.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    error = refused.value.body
    assert error["code"] == "input_too_long" and "at most 200" in error["message"]
    # The same refusal as the gateway's own on a count it knows (token ids).
    with pytest.raises(openai.BadRequestError) as own:
        capped.completions.create(model=MODEL, prompt=[7] * 201, max_tokens=4)
    assert own.value.body["code"] == "input_too_long"
    assert own.value.body["message"] == "the prompt has 201 tokens; this key allows at most 200"
    # Under the cap, by the replica's count, it is served; another tenant has no cap.
    short = [{"role": "user", "content": "漢字" * 20}]
    assert capped.chat.completions.create(model=MODEL, messages=short, max_tokens=4).choices
    answer = client(gateway, OPEN).chat.completions.create(model=MODEL, messages=messages,
                                                           max_tokens=4)  # fmt: skip
    assert answer.usage.prompt_tokens > 300


# Item: tokens per minute reserve the output ------------------------------------------------
def test_concurrent_requests_cannot_spend_past_the_tokens_per_minute(
    gateway: GatewayProcess,
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 150,
            "ignore_eos": True}  # fmt: skip

    async def four() -> list[httpx.Response]:
        headers = {"authorization": f"Bearer {METERED}"}
        async with httpx.AsyncClient(timeout=60) as http:
            url = f"{gateway.url}/v1/chat/completions"
            return await asyncio.gather(
                *[http.post(url, json=body, headers=headers) for _ in range(4)]
            )

    responses = asyncio.run(four())
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    used = sum(r.json()["usage"]["total_tokens"] for r in served)
    assert served and used <= 300, [r.status_code for r in responses]
    assert all(r.status_code == 429 and r.headers.get("retry-after") for r in refused)
    assert all(r.json()["error"]["code"] == "tokens_per_minute" for r in refused)


# Item: client input is no replica fault ----------------------------------------------------
def test_a_template_refusing_the_messages_is_a_400_and_no_replica_fault(
    gateway: GatewayProcess,
) -> None:
    open_ = client(gateway, OPEN)
    twice = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    for _ in range(5):  # past the breaker's threshold of 3
        with pytest.raises(openai.BadRequestError) as refused:
            open_.chat.completions.create(model=MODEL, messages=twice, max_tokens=4)
        assert refused.value.body["param"] == "messages"
        assert "must alternate" in refused.value.body["message"]
    assert gateway.metric("modelship_gateway_upstream_failures_total") == 0
    assert gateway.metric("modelship_gateway_retries_total") == 0
    answer = open_.chat.completions.create(model=MODEL, messages=twice[:1], max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")


# Item: the cache namespace is never dropped ------------------------------------------------
def test_a_gateway_with_tenants_refuses_replicas_without_a_key(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.yaml"
    tenants = [{"name": "a", "api_key_sha256": hash_api_key("sk-a")}]
    config.write_text(yaml.safe_dump({"gateway": {"tenants": tenants}}))
    env = {k: v for k, v in os.environ.items() if k != "MODELSHIP_API_KEY"}
    result = subprocess.run(
        [sys.executable, "-m", "modelship", "gateway", "--config", str(config),
         "--endpoint", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "serve.api_key" in result.stderr and "gateway.tenants" in result.stderr


def test_behind_vllm_the_namespace_is_its_cache_salt_field(tmp_path: Path) -> None:
    server = VllmStandIn("--scheduling-policy", "priority")
    tenants = [{"name": n, "api_key_sha256": hash_api_key(f"sk-{n}")} for n in ("a", "b")]
    deploy = {"serving": {"engine": "vllm", "gpu": {"count": 1}}}  # the engine kind from here
    gateway = GatewayProcess(
        tmp_path, {"tenants": tenants}, "--endpoint", server.url,
        api_key=REPLICA_KEY, sections={"deploy": deploy},
    )  # fmt: skip
    try:
        gateway.wait_ready(60)
        for name in ("a", "b", "a"):
            # A client naming another tenant's salt changes nothing: the gateway's wins.
            client(gateway, f"sk-{name}").completions.create(
                model=MODEL, prompt="hi", max_tokens=4,
                extra_body={"cache_salt": "chosen-by-the-client"},
            )  # fmt: skip
        bodies = server.requests()
    finally:
        assert gateway.stop() == 0, gateway.log_tail()
        server.stop()
    salts = [body["cache_salt"] for body in bodies]
    assert len(salts) == 3 and salts[0] == salts[2] != salts[1]
    assert "chosen-by-the-client" not in salts
    assert not any("return_token_ids" in body for body in bodies)
