"""`modelship run` on the families besides Llama: a tiny Qwen3-MoE and a tiny Gemma 2 (random
weights, built here) go through acquire from their folder, optimize (fp16, awq, gptq),
select and a real `modelship serve` of the winner."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import yaml

from modelship.storage import Storage, read_manifest

from pipeline_config import TINY
from server_process import ServerProcess
from tiny_models import save_tiny_gemma2, save_tiny_moe

# two whole pipeline runs, about 4 minutes in CI: handed to a worker first (tests/conftest.py)
pytestmark = pytest.mark.long

# Every projection's input width a multiple of the int4 group size (64), as llm-compressor
# and the W4A8 kernel need.
BUILDERS = {
    "qwen3_moe": lambda folder: save_tiny_moe(
        "qwen3_moe", folder, hidden_size=128, intermediate_size=128, moe_intermediate_size=128
    ),
    "gemma2": lambda folder: save_tiny_gemma2(folder, intermediate_size=128),
}
VARIANTS = ("fp16", "awq", "gptq")


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_run_optimizes_selects_and_serves(family: str, tmp_path: Path) -> None:
    source = BUILDERS[family](tmp_path / family)
    storage = Storage(tmp_path / "data")
    config = tmp_path / "pipeline.yaml"
    data = {**TINY, "source": str(source), "name": "tiny", "storage": str(storage.root)}
    config.write_text(yaml.safe_dump(data))

    run = subprocess.run(
        [sys.executable, "-m", "modelship", "run", "--no-serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-3000:]

    architecture = json.loads((source / "config.json").read_text())["architectures"]
    for variant in VARIANTS:  # each made from this family's checkpoint, not skipped
        folder = storage.variant_dir("tiny", variant)
        assert read_manifest(folder).extra["recipe"]["scheme"] == variant
        written = json.loads((folder / "config.json").read_text())
        assert written["architectures"] == architecture
    quantized = json.loads((storage.variant_dir("tiny", "gptq") / "config.json").read_text())
    if family == "qwen3_moe":  # the routers stay in full precision
        assert "model.layers.0.mlp.gate" in quantized["quantization_config"]["ignore"]

    production = storage.production_link("tiny")
    metrics = json.loads((production / "production_metrics.json").read_text())
    winner = metrics["variant"]
    # a variant, or one served with other numerics (`<variant>-int4head`: its source's files)
    assert metrics["evaluations"][winner].get("source_variant", winner) in VARIANTS
    assert metrics["ranking"][0]["variant"] == winner
    evaluation = json.loads((storage.evaluations_dir("tiny") / f"{winner}.json").read_text())
    assert evaluation["serving"]["failed_requests"] == 0
    report = (production / "report.md").read_text()
    lines = report.splitlines()
    assert f"**{winner}** won with score {metrics['score']:.3f}" in report
    # the numbers it won on: its row of the scores table, its measured throughput
    assert any(line.startswith(f"| {winner} | yes | {metrics['score']:.3f} |") for line in lines)
    assert evaluation["serving"]["throughput_tok_s"] > 0
    assert any(line.startswith("| output tok/s under load") for line in lines)

    server = ServerProcess(production, "--served-model-name", "tiny", "--max-model-len", "256",
                           "--kv-cache-memory-mb", "16")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(
            model="tiny",
            prompt="The quick brown fox",
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},  # random weights may pick the end token first
        )
        assert completion.usage.completion_tokens == 4
        assert completion.choices[0].text
    finally:
        server.stop()
