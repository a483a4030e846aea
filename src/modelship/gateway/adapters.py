"""LoRA adapters loaded and unloaded at runtime for a whole fleet, through the gateway.

`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's bodies) on the gateway
take an admin key (`gateway.admin_api_key_sha256`) and are sent on to every replica's own
endpoint (replicas run with `--enable-lora-admin`). Checked first: the name
(`adapter_names`), and the folder, which must lie under one of `gateway.adapter_roots` (as
the replicas see their filesystem).

The answer reports every replica's result. 200 once every replica serves the adapter
(`loaded`, or `already_loaded` from that very folder: a call can be repeated after a
partial failure); a replica refusing, a name served from another folder (409) included, is
the answer's status, with the number of replicas the call was done on. Unloading counts a
replica that does not serve the name as done, and answers 404 when none did.
"""

from __future__ import annotations

import asyncio
import json
import posixpath
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import PurePosixPath
from typing import Any, Literal

import httpx

from modelship.adapter_names import ADAPTER_NAME_RULE, is_adapter_name
from modelship.gateway.request import GatewayError

Action = Literal["load", "unload"]


def parse_body(raw: bytes, action: Action, roots: Sequence[str]) -> dict[str, str]:
    """The admin call's body: `lora_name` (and, to load, `lora_path` under one of
    `roots`, normalized), strings."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise GatewayError(400, "the body is not JSON", code="invalid_json") from None
    fields = ("lora_name", "lora_path") if action == "load" else ("lora_name",)
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object", code="invalid_body")
    for name in fields:
        if not isinstance(body.get(name), str) or not body[name].strip():
            raise GatewayError(400, f"`{name}` must be a non-empty string", param=name,
                               code="invalid_body")  # fmt: skip
    unknown = set(body) - set(fields)
    if unknown:
        raise GatewayError(400, f"unknown field(s): {', '.join(sorted(unknown))}",
                           code="invalid_body")  # fmt: skip
    if not is_adapter_name(body["lora_name"]):
        raise GatewayError(400, f"`lora_name`: a name is {ADAPTER_NAME_RULE}",
                           param="lora_name", code="invalid_body")  # fmt: skip
    parsed = {name: body[name] for name in fields}
    if action == "load":
        parsed["lora_path"] = check_path(body["lora_path"], roots)
    return parsed


def check_path(path: str, roots: Sequence[str]) -> str:
    """`path` normalized (`..` taken out), if it lies under one of `roots`: an admin key
    must not make replicas read any folder they can. Lexical, as the replicas' filesystem
    is not the gateway's; the local fleet also resolves links (`is_under`)."""
    if not roots:
        raise GatewayError(403, "loading adapters needs gateway.adapter_roots (the folders "
                           "adapters may be loaded from)", "permission_error",
                           param="lora_path", code="forbidden")  # fmt: skip
    normal = posixpath.normpath(path)
    if not normal.startswith("/") or not is_under(normal, roots):
        raise GatewayError(403, f"`lora_path` must be an absolute folder under one of "
                           f"gateway.adapter_roots ({', '.join(roots)})", "permission_error",
                           param="lora_path", code="forbidden")  # fmt: skip
    return normal


def is_under(path: str, roots: Sequence[str]) -> bool:
    """`path` lies strictly inside one of `roots` (all absolute and normalized)."""
    return any(
        PurePosixPath(path) != PurePosixPath(root) and PurePosixPath(path).is_relative_to(root)
        for root in roots
    )


@dataclass(frozen=True)
class ReplicaResult:
    """What one replica answered: `result` is `loaded`, `already_loaded`, `unloaded`,
    `not_loaded`, or the replica's refusal."""

    replica: str
    status_code: int
    result: str


@dataclass(frozen=True)
class FanOut:
    """The gateway's answer (`status_code`, `body`) and each replica's `results`."""

    status_code: int
    body: dict[str, Any]
    results: list[ReplicaResult]

    def replicas_with(self, result: str) -> list[str]:
        return [r.replica for r in self.results if r.result == result]


async def fan_out(
    client: httpx.AsyncClient,
    replicas: Sequence[tuple[str, str]],  # (replica id, base URL)
    action: Action,
    body: dict[str, str],
    headers: dict[str, str],
    timeout_s: float,
) -> FanOut:
    """Send the call to every replica at once; the answer reports each one."""
    if not replicas:
        raise GatewayError(503, "no replica is running; retry shortly", "service_unavailable")

    async def send(replica: str, url: str) -> tuple[ReplicaResult, dict[str, Any]]:
        try:
            response = await client.post(f"{url}/v1/{action}_lora_adapter", json=body,
                                          headers=headers, timeout=timeout_s)  # fmt: skip
        except httpx.HTTPError as exc:
            return ReplicaResult(replica, 502, f"no answer: {exc!r}"), {}
        try:
            payload = response.json()
        except ValueError:
            payload = {"error": {"message": response.text[:200]}}
        payload = payload if isinstance(payload, dict) else {}
        status = response.status_code
        if status == 200:
            result = str(payload.get("status") or ("loaded" if action == "load" else "unloaded"))
        elif status == 404 and action == "unload":
            result = "not_loaded"
        else:
            error = payload.get("error") if isinstance(payload.get("error"), dict) else {}
            result = str(error.get("message") or payload.get("message") or "refused")
        return ReplicaResult(replica, status, result), payload

    answers = await asyncio.gather(*(send(replica, url) for replica, url in replicas))
    results = [result for result, _ in answers]
    report = [asdict(result) for result in results]
    failed = [(r, payload) for r, payload in answers if r.status_code not in (200, 404)
              or (r.status_code == 404 and action == "load")]  # fmt: skip
    name = body["lora_name"]
    if not failed and action == "unload" and all(r.status_code == 404 for r in results):
        error = {"message": f"no replica serves the adapter `{name}`", "type": "NotFoundError",
                 "param": "lora_name", "code": "not_found"}  # fmt: skip
        return FanOut(404, {"error": error, "replicas": report}, results)
    if not failed:
        status = "loaded" if action == "load" else "unloaded"
        answer = {"object": "lora_adapter", "id": name, "status": status, "replicas": report}
        return FanOut(200, answer, results)
    first, payload = failed[0]
    error = payload.get("error") if isinstance(payload.get("error"), dict) else {}
    num_done = len(results) - len(failed)
    message = f"{first.replica}: {first.result} (done on {num_done} of {len(results)} replicas)"
    error = {"message": message, "type": error.get("type", "api_error"),
             "param": error.get("param"), "code": error.get("code")}  # fmt: skip
    return FanOut(first.status_code, {"error": error, "replicas": report}, results)
