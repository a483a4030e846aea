"""How `modelship up` starts a replica: the real launcher the supervisor calls."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from modelship.config import ModelshipConfig
from modelship.fleet.local import LocalFleet
from modelship.storage import Storage

from fleet_storage import publish_release

pytestmark = pytest.mark.timeout(180)

SLUG = "tiny"
REPLICA_KEY = "sk-replica-secret-4f1c"


def test_the_replica_key_is_in_the_environment_not_on_the_command_line(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = Storage(tmp_path / "storage")
    release = publish_release(storage, SLUG, tiny_llama_dir, "fp16")
    storage.set_production(SLUG, release)
    config = ModelshipConfig.from_dict(
        {
            "serve": {
                "api_key": REPLICA_KEY,
                "engine": {"max_model_len": 256, "kv_cache_memory_mb": 16},
            }
        }
    )
    monkeypatch.setenv("MODELSHIP_API_KEY", "sk-not-this-one")  # ours must not leak through
    fleet = LocalFleet(config, storage, SLUG)
    replica = fleet._launch(fleet.release_spec(release), "replica-1")  # what the supervisor runs
    try:
        cmdline = Path(f"/proc/{replica.pid}/cmdline").read_bytes()
        assert b"modelship" in cmdline and b"serve" in cmdline
        assert REPLICA_KEY.encode() not in cmdline
        assert b"--api-key" not in cmdline
        replica.wait_ready(120)
        models = f"{replica.url}/v1/models"
        assert httpx.get(models, timeout=10).status_code == 401
        wrong = {"authorization": "Bearer sk-not-this-one"}
        assert httpx.get(models, headers=wrong, timeout=10).status_code == 401
        right = {"authorization": f"Bearer {REPLICA_KEY}"}
        assert httpx.get(models, headers=right, timeout=10).status_code == 200
    finally:
        assert replica.stop() == 0, replica.log_tail()


def test_replicas_take_the_gateways_request_caps(tiny_llama_dir: Path, tmp_path: Path) -> None:
    storage = Storage(tmp_path / "storage")
    release = publish_release(storage, SLUG, tiny_llama_dir, "fp16")
    storage.set_production(SLUG, release)
    config = ModelshipConfig.from_dict(
        {
            "serve": {"engine": {"max_model_len": 256, "kv_cache_memory_mb": 16}},
            "gateway": {"request_limits": {"max_n": 20, "max_stop": 2}},
        }
    )
    fleet = LocalFleet(config, storage, SLUG)
    replica = fleet._launch(fleet.release_spec(release), "replica-1")
    try:
        replica.wait_ready(120)
        url = f"{replica.url}/v1/completions"
        body = {"model": fleet.served_model_name, "prompt": "hello", "max_tokens": 2}
        key = {"authorization": f"Bearer {fleet.replica_api_key}"}  # `up` always makes one
        # above the replica's own default (16), within the gateway's cap: served
        response = httpx.post(url, json=body | {"n": 18}, headers=key, timeout=60)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 18
        # below the default (16 stop strings), beyond the gateway's cap: refused the same way
        response = httpx.post(url, json=body | {"stop": ["a", "b", "c"]}, headers=key, timeout=60)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "stop"
    finally:
        assert replica.stop() == 0, replica.log_tail()
