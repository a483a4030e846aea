"""Two `modelship gateway` processes writing one usage ledger (`--usage-dir`), as gateway
replicas on Kubernetes write to the models volume: each appends to a file of its own, and
`modelship usage` reads every file, so concurrent requests through both are all counted,
none twice."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gateway_process import GatewayProcess
from modelship.gateway import hash_api_key
from modelship.gateway.cost import UsageLedger, UsageRecord, read_usage, summarize
from vllm_stand_in import VllmStandIn

REPLICA_KEY = "sk-replica-ledger"
TENANT_KEY = "sk-ledger-tenant"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def replica() -> Iterator[VllmStandIn]:
    server = VllmStandIn()
    yield server
    server.stop()


def start_gateway(tmp_path: Path, replica: VllmStandIn, usage_dir: Path) -> GatewayProcess:
    gateway = {"tenants": [{"name": "acme", "api_key_sha256": hash_api_key(TENANT_KEY)}]}
    process = GatewayProcess(
        tmp_path, gateway, "--endpoint", replica.url, "--engine", "vllm",
        "--usage-dir", str(usage_dir), api_key=REPLICA_KEY,
    )  # fmt: skip
    process.wait_ready(60)
    return process


def post(gateway: GatewayProcess, i: int) -> int:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1 + i % 5, "stream": i % 2 == 0}
    headers = {"authorization": f"Bearer {TENANT_KEY}"}
    with httpx.Client(timeout=30) as client:
        response = client.post(f"{gateway.url}/v1/completions", json=body, headers=headers)
        response.read()
    return response.status_code


def test_two_gateways_one_ledger_exact_totals(
    replica: VllmStandIn, tmp_path_factory: pytest.TempPathFactory
) -> None:
    usage_dir = tmp_path_factory.mktemp("models") / "usage"
    gateways = [
        start_gateway(tmp_path_factory.mktemp(f"gateway{n}"), replica, usage_dir) for n in (1, 2)
    ]
    try:
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda i: post(gateways[i % 2], i), range(60)))
    finally:
        for gateway in gateways:
            assert gateway.stop() == 0, gateway.log_tail()
    assert statuses == [200] * 60
    files = sorted(usage_dir.glob("*.jsonl"))
    assert len(files) == 2, files  # a file per gateway
    since = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    [row] = summarize(read_usage(usage_dir, since))
    assert row["tenant"] == "acme" and row["requests"] == 60
    assert row["input_tokens"] == 2 * 60  # the stand-in counts 2 prompt tokens
    assert row["output_tokens"] == sum(1 + i % 5 for i in range(60))


def test_a_single_writers_ledger_and_writers_files_read_together(tmp_path: Path) -> None:
    """`modelship up`'s one gateway keeps `<date>.jsonl`; files of named writers on the same
    day are read with it, and a writer's name cannot leave the folder."""
    record = UsageRecord("2026-11-26T05:00:00.000+00:00", "a", "m", "1", "fp16", 200, 3, 4, None)
    for writer in (None, "gateway-0-17", "gateway-1-17"):
        ledger = UsageLedger(tmp_path, writer)
        ledger.append(record)
        ledger.close()
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == [
        "2026-11-26.gateway-0-17.jsonl", "2026-11-26.gateway-1-17.jsonl", "2026-11-26.jsonl",
    ]  # fmt: skip
    since = dt.datetime(2026, 11, 26, tzinfo=dt.UTC)
    assert len(list(read_usage(tmp_path, since))) == 3
    assert list(read_usage(tmp_path, since + dt.timedelta(days=1))) == []
    with pytest.raises(ValueError, match="writer"):
        UsageLedger(tmp_path, "../elsewhere")
