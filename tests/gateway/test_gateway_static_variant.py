"""A replica given by address serving `production` (how Kubernetes runs it): nothing on its
command line names the variant select published, yet its metrics, the gateway's answers
and the gateway's prices carry that variant, read from the release's manifest."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway_process import GatewayProcess
from modelship.storage import Manifest

from server_process import ServerProcess

MODEL = "tiny"
pytestmark = pytest.mark.timeout(180)


def release_of(model_dir: Path, folder: Path, variant: str) -> Path:
    """A published release folder (links to the model's files, a manifest naming the
    variant), as select writes `releases/<n>` that `production` points at."""
    folder.mkdir()
    for path in model_dir.iterdir():
        (folder / path.name).symlink_to(path)
    manifest = Manifest(kind="release", source=str(model_dir), revision=None,
                        inputs_hash="0" * 64, extra={"variant": variant})  # fmt: skip
    (folder / "manifest.json").write_text(manifest.to_json())
    return folder


def test_a_production_replica_is_labelled_and_priced_as_its_variant(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    production = release_of(tiny_llama_dir, tmp_path / "production", "int8")
    replica = ServerProcess(production, "--served-model-name", MODEL,
                            "--kv-cache-memory-mb", "32")  # fmt: skip
    price = {"input_per_1k": 1.0, "output_per_1k": 2.0}
    gateway = GatewayProcess(tmp_path, {"cost": {"variants": {"int8": price}}},
                             "--endpoint", replica.url)  # fmt: skip
    try:
        assert httpx.get(f"{replica.url}/ready").json()["variant"] == "int8"
        assert 'variant="int8"' in httpx.get(f"{replica.url}/metrics").text
        gateway.wait_ready(60)
        body = {"model": MODEL, "prompt": "one two", "max_tokens": 3}
        answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-modelship-variant"] == "int8"
        assert gateway.metric("modelship_gateway_cost_total", variant="int8") > 0
    finally:
        gateway.stop()
        replica.stop()
