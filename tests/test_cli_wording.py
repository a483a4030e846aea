"""What the command line says of a mistyped or misused config and of refused requests'
usage, through the real command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from starlette.testclient import TestClient

from modelship.gateway.app import create_gateway_app
from modelship.gateway.config import GatewayConfig
from modelship.gateway.cost import USAGE_DIR, UsageLedger, UsageRecord, now_utc
from modelship.gateway.pool import EndpointPool
from modelship.gateway.service import GatewayService
from modelship.pipeline.acquire import acquire
from modelship.storage import Storage


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "modelship", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "250"},
    )


def test_an_unknown_config_key_gets_the_nearest_known_one(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text("selct:\n  preset: chat\nserve:\n  engine:\n    max_num_seq: 8\n")
    result = run_cli("status", "--config", str(config), "--storage", str(tmp_path))
    assert result.returncode == 2
    assert f"{config}: selct: Extra inputs are not permitted; did you mean `select`?" in (
        result.stderr
    )
    assert "serve.engine.max_num_seq: Extra inputs are not permitted; did you mean " \
        "`max_num_seqs`?" in result.stderr  # fmt: skip


def test_a_tenant_with_a_plain_key_is_told_how_to_hash_it(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text("gateway:\n  tenants:\n  - name: team-a\n    api_key: sk-secret-1\n")
    result = run_cli("status", "--config", str(config), "--storage", str(tmp_path))
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "gateway.tenants.0: api_key: a tenant takes its key's sha256" in line
    assert 'printf %s "$KEY" | sha256sum' in line
    assert "sk-secret-1" not in line and "Field required" not in line


def test_usage_counts_refused_requests_without_their_tokens_and_says_where_prices_live(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    storage = Storage(tmp_path)
    acquire(str(tiny_llama_dir), storage, name="my-model")
    ledger = UsageLedger(storage.model_dir("my-model") / USAGE_DIR)
    # A request the gateway admits and no replica serves (none is there): a 503.
    config = GatewayConfig()
    service = GatewayService(config, EndpointPool(config.resilience))
    service.accounting.ledger = ledger
    client = TestClient(create_gateway_app(service, health_checks=False))
    response = client.post("/v1/completions", json={"model": "m", "prompt": "word " * 3000})
    assert response.status_code == 503
    # And one served request of a variant with no price, as the gateway records it.
    ledger.append(UsageRecord(now_utc(), "default", "my-model", "1", "fp16", 200, 7, 3, None))
    ledger.close()

    rows = json.loads(run_cli("usage", "--json", "--storage", str(tmp_path)).stdout)
    refused = next(row for row in rows if row["refused_requests"])
    assert (refused["requests"], refused["input_tokens"], refused["output_tokens"]) == (1, 0, 0)

    table = run_cli("usage", "--storage", str(tmp_path))
    assert table.returncode == 0, table.stderr
    assert "(not served)" in table.stdout and "unknown" not in table.stdout
    assert "0.0000" not in table.stdout and "unpriced" in table.stdout
    assert "prices come from pipeline.yaml's gateway.cost" in table.stdout
