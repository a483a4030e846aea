"""LoRA adapters loaded and unloaded at runtime for a whole fleet, through the gateway.

`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's bodies) on the gateway
take an admin key (`gateway.admin_api_key_sha256`) and are sent on to every replica's own
endpoint (replicas run with `--enable-lora-admin`). The answer is 200 once every replica
has done it, else the first replica's refusal, saying on how many it was done. A replica
that already serves the name (409 on load) or does not (404 on unload) counts as done, so
a call can be repeated after a partial failure.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, Literal

import httpx

from modelship.gateway.request import GatewayError

Action = Literal["load", "unload"]
_ALREADY = {"load": 409, "unload": 404}  # the replica is already where the call leads


def parse_body(raw: bytes, action: Action) -> dict[str, str]:
    """The admin call's body: `lora_name` (and, to load, `lora_path`), strings."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise GatewayError(400, "the body is not JSON", code="invalid_json") from None
    fields = ("lora_name", "lora_path") if action == "load" else ("lora_name",)
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object", code="invalid_body")
    for name in fields:
        if not isinstance(body.get(name), str) or not body[name].strip():
            raise GatewayError(400, f"`{name}` must be a non-empty string", code="invalid_body")
    unknown = set(body) - set(fields)
    if unknown:
        raise GatewayError(400, f"unknown field(s): {', '.join(sorted(unknown))}",
                           code="invalid_body")  # fmt: skip
    return {name: body[name] for name in fields}


async def fan_out(
    client: httpx.AsyncClient,
    replicas: Sequence[tuple[str, str]],  # (replica id, base URL)
    action: Action,
    body: dict[str, str],
    headers: dict[str, str],
    timeout_s: float,
) -> tuple[int, dict[str, Any]]:
    """Send the call to every replica; (status, JSON body) for the gateway's answer."""
    if not replicas:
        raise GatewayError(503, "no replica is running; retry shortly", "service_unavailable")

    async def send(url: str) -> tuple[int, dict[str, Any]]:
        try:
            response = await client.post(f"{url}/v1/{action}_lora_adapter", json=body,
                                          headers=headers, timeout=timeout_s)  # fmt: skip
        except httpx.HTTPError as exc:
            return 502, {"error": {"message": f"no answer: {exc!r}"}}
        try:
            payload = response.json()
        except ValueError:
            payload = {"error": {"message": response.text[:200]}}
        return response.status_code, payload if isinstance(payload, dict) else {}

    answers = await asyncio.gather(*(send(url) for _, url in replicas))
    done = [rid for (rid, _), (status, _) in zip(replicas, answers, strict=True)
            if status == 200 or status == _ALREADY[action]]  # fmt: skip
    if len(done) == len(replicas):
        status = "loaded" if action == "load" else "unloaded"
        return 200, {"object": "lora_adapter", "id": body["lora_name"], "status": status,
                     "replicas": done}  # fmt: skip
    rid, (status, payload) = next(
        (rid, answer) for (rid, _), answer in zip(replicas, answers, strict=True)
        if rid not in done
    )  # fmt: skip
    error = payload.get("error") if isinstance(payload.get("error"), dict) else {}
    said = error.get("message", "refused")
    message = f"{rid}: {said} (done on {len(done)} of {len(replicas)} replicas)"
    return status, {"error": {"message": message, "type": error.get("type", "api_error"),
                              "param": error.get("param"), "code": error.get("code")}}  # fmt: skip
