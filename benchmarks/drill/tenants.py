"""Drill 7, tenant isolation, through `modelship up` with two tenants (A, B) and a
replica key made up by the fleet:

- A's key acts as A only: a header or body field naming B changes nothing, and a key
  that is almost A's is refused;
- B's model allow list holds for B (a model it may not use is refused, with an OpenAI
  error body) and does not limit A;
- B's rate budget runs out for B alone: B gets 429 with Retry-After, A goes on;
- the failover's body fields (`resume_token_ids`, `return_token_ids`) are the gateway's:
  a client sending them gets a 400 naming the field, and the replica takes nothing from a
  client without its key;
- C's `max_input_tokens` holds on the real token count: a prompt of CJK characters and
  emoji, under the cap by characters / 4 and far over it in tokens, is refused with the
  gateway's own 400 (`input_too_long`) by the replica that counted it;
- the prefix cache is per tenant: A's repeated prompt hits A's blocks, B's same prompt
  never does (so the timing of a hit cannot reveal A's prompt to B), and A's greedy
  answer is identical with and without the hit;
- no key appears in the logs, in /metrics (with or without the metrics key) or in any
  error body the drill provoked;
- then a second fleet (`tenants_routing.py`): routing memory, /metrics, a named tier and a
  canary as one tenant would use them against another.
"""

from __future__ import annotations

import httpx

from modelship.gateway import hash_api_key
from modelship.storage import Storage

from drill.common import DrillContext, DrillResult, is_openai_error, secrets_found
from drill.tenants_routing import run_routing
from fleet_process import UpProcess
from fleet_storage import publish_release

SLUG = "drill"
KEY_A, KEY_B, METRICS_KEY = "sk-drill-tenant-a-0123", "sk-drill-tenant-b-4567", "sk-drill-m-89"
KEY_C = "sk-drill-tenant-c-2468"
MAX_INPUT_TOKENS = 200
# 700 characters: 175 "tokens" by characters / 4, several hundred by any tokenizer.
WIDE_PROMPT = "🚀漢" * 350
PROMPT = "Prefix caching reuses the key and value blocks of a prompt seen before. " * 3


def run(context: DrillContext) -> DrillResult:
    result = DrillResult("tenants")
    storage = Storage(context.work_dir / "storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, context.model_dir, "fp16"))
    config = {
        "serve": {"engine": {"max_model_len": 256, "kv_cache_memory_mb": 16}},
        "gateway": {
            "tenants": [
                {"name": "a", "api_key_sha256": hash_api_key(KEY_A)},
                {"name": "b", "api_key_sha256": hash_api_key(KEY_B), "requests_per_minute": 3,
                 "allowed_models": ["another-model"]},
                {"name": "c", "api_key_sha256": hash_api_key(KEY_C),
                 "max_input_tokens": MAX_INPUT_TOKENS},
            ],
            "metrics_api_key_sha256": hash_api_key(METRICS_KEY),
        },
        "autoscale": {"min_replicas": 1, "max_replicas": 1},
    }  # fmt: skip
    up = UpProcess(config, storage.root, SLUG, context.work_dir)
    bodies: list[str] = []
    try:
        up.wait_ready(timeout_s=180)
        _keys(up, result, bodies)
        _allow_list_and_budget(up, result, bodies)
        _failover_fields(up, result, bodies)
        _input_cap(up, result, bodies)
        _prefix_cache(up, result)
        metrics = [
            httpx.get(f"{up.url}/metrics", timeout=10).text,
            httpx.get(f"{up.url}/metrics", headers=_auth(METRICS_KEY), timeout=10).text,
        ]
    finally:
        code = up.stop()
    result.check("the fleet stops cleanly", code == 0, f"exit {code}")
    keys = (KEY_A, KEY_B, KEY_C)
    leaks = secrets_found([up.log_path], [*keys, METRICS_KEY])
    leaks += [f"/metrics: {k[:6]}..." for k in keys for text in metrics if k in text]
    leaks += [f"error body: {k[:6]}..." for k in keys for b in bodies if k in b]
    result.check("no key in logs, metrics or error bodies", not leaks, "; ".join(leaks))
    result.figures["error_bodies_checked"] = len(bodies)
    run_routing(context, result)
    return result


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _ask(up: UpProcess, key: str, model: str = SLUG, prompt: str = "Hello", **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    headers = {**_auth(key), **extra.pop("headers", {})} if "headers" in extra else _auth(key)
    return httpx.post(f"{up.url}/v1/completions", json=body, headers=headers, timeout=60)


def _keys(up: UpProcess, result: DrillResult, bodies: list[str]) -> None:
    near = _ask(up, KEY_A[:-1] + "X")
    missing = httpx.post(f"{up.url}/v1/completions", json={"model": SLUG, "prompt": "x"},
                         timeout=30)  # fmt: skip
    bodies += [near.text, missing.text]
    result.check(
        "a key one character off, or none, is refused (401, OpenAI error body)",
        near.status_code == missing.status_code == 401 and is_openai_error(near),
        f"{near.status_code} / {missing.status_code}",
    )
    up.metrics_key = METRICS_KEY  # per-tenant series need the metrics key
    before = up.metric("modelship_gateway_requests_total", tenant="b")
    spoofed = httpx.post(
        f"{up.url}/v1/completions",
        json={"model": SLUG, "prompt": "Hello", "max_tokens": 2, "user": "b"},
        headers={**_auth(KEY_A), "x-modelship-tenant": "b", "x-tenant": "b"},
        timeout=60,
    )
    after = up.metric("modelship_gateway_requests_total", tenant="b")
    result.check(
        "A's key naming B (header, user field) is still A: nothing is charged to B",
        spoofed.status_code == 200 and after == before,
        f"{spoofed.status_code}; B's requests {before} -> {after}",
    )


def _allow_list_and_budget(up: UpProcess, result: DrillResult, bodies: list[str]) -> None:
    refused = _ask(up, KEY_B)
    bodies.append(refused.text)
    result.check(
        "B may not use a model off its allow list (4xx, OpenAI error body)",
        400 <= refused.status_code < 500 and refused.status_code != 429
        and is_openai_error(refused),
        f"{refused.status_code} {refused.text[:200]}",
    )  # fmt: skip
    result.check("A is not limited by B's allow list", _ask(up, KEY_A).status_code == 200)
    codes = []
    for _ in range(6):
        response = _ask(up, KEY_B, model="another-model")
        bodies.append(response.text)
        codes.append((response.status_code, response.headers.get("retry-after")))
    limited = [c for c in codes if c[0] == 429]
    result.check(
        "B's rate budget runs out: 429 with Retry-After",
        bool(limited) and all(retry for _, retry in limited),
        str(codes),
    )
    a_after = [_ask(up, KEY_A).status_code for _ in range(3)]
    result.check("A goes on while B is limited", a_after == [200] * 3, str(a_after))


def _failover_fields(up: UpProcess, result: DrillResult, bodies: list[str]) -> None:
    seen = []
    for name, value in [("resume_token_ids", [0, 1, 2] * 300), ("return_token_ids", True)]:
        response = _ask(up, KEY_A, stream=True, **{name: value})
        bodies.append(response.text)
        param = response.json()["error"]["param"] if is_openai_error(response) else None
        seen.append((name, response.status_code, param))
    result.check(
        "a client sending the failover's fields gets a 400 naming the field",
        all(status == 400 and param == name for name, status, param in seen),
        str(seen),
    )
    (replica,) = up.replicas()
    body = {"model": SLUG, "prompt": "Hello", "max_tokens": 4, "stream": True,
            "resume_token_ids": [0, 1, 2]}  # fmt: skip
    direct = httpx.post(f"{up.replica_url(replica)}/v1/completions", json=body, timeout=30)
    bodies.append(direct.text)
    result.check(
        "the replica takes them from no client without its key (401)",
        direct.status_code == 401 and is_openai_error(direct),
        f"{direct.status_code} {direct.text[:200]}",
    )


def _input_cap(up: UpProcess, result: DrillResult, bodies: list[str]) -> None:
    messages = [{"role": "user", "content": WIDE_PROMPT}]
    body = {"model": SLUG, "messages": messages, "max_tokens": 4}
    response = httpx.post(f"{up.url}/v1/chat/completions", json=body, headers=_auth(KEY_C),
                          timeout=60)  # fmt: skip
    bodies.append(response.text)
    error = response.json()["error"] if is_openai_error(response) else {}
    result.check(
        f"C's max_input_tokens ({MAX_INPUT_TOKENS}) holds on the replica's token count "
        f"({len(WIDE_PROMPT)} CJK characters and emoji: 400 input_too_long)",
        response.status_code == 400 and error.get("code") == "input_too_long",
        f"{response.status_code} {response.text[:200]}",
    )
    own = _ask(up, KEY_C, prompt=[5] * (MAX_INPUT_TOKENS + 1))
    bodies.append(own.text)
    same = is_openai_error(own) and own.json()["error"] == {**error, "message": (
        f"the prompt has {MAX_INPUT_TOKENS + 1} tokens; this key allows at most "
        f"{MAX_INPUT_TOKENS}")}  # fmt: skip
    result.check(
        "the replica's refusal is the gateway's own (token ids it counts itself)",
        own.status_code == 400 and same,
        f"{own.status_code} {own.text[:200]} vs {error}",
    )


def _prefix_hits(up: UpProcess) -> float:
    (replica,) = up.replicas()
    text = httpx.get(f"{up.replica_url(replica)}/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("modelship:prefix_cache_hits_total")
    )


def _prefix_cache(up: UpProcess, result: DrillResult) -> None:
    hits = []
    texts = []
    for key in (KEY_A, KEY_B, KEY_A):
        before = _prefix_hits(up)
        model = SLUG if key == KEY_A else "another-model"
        body = {"model": SLUG, "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 12, "temperature": 0}  # fmt: skip
        if key == KEY_B:
            body["model"] = model
        response = httpx.post(f"{up.url}/v1/chat/completions", json=body, headers=_auth(key),
                              timeout=60)  # fmt: skip
        hits.append(_prefix_hits(up) - before)
        texts.append(response.json()["choices"][0]["message"]["content"]
                     if response.status_code == 200 else f"<{response.status_code}>")  # fmt: skip
    result.figures["prefix_hits_a_b_a"] = [int(h) for h in hits]
    result.check("A's repeated prompt hits A's cached prefix", hits[2] > 0, str(hits))
    result.check("B's same prompt never hits A's blocks", hits[1] == 0, str(hits))
    result.check(
        "A's greedy answer is identical with and without a prefix hit",
        texts[0] == texts[2],
        f"{texts[0]!r} vs {texts[2]!r}",
    )
