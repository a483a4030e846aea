"""Tensor parallelism on CPU with 2 ranks (gloo): the same logits and greedy tokens as one
rank, on a model whose heads split unevenly (3 kv heads: 2 + 1); a worker that dies fails
the engine, and ends `modelship serve`, instead of hanging it."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import openai
import pytest
import torch

from modelship import SamplingParams
from modelship.engine.config import EngineConfig
from modelship.engine.llm_engine import LLMEngine
from modelship.engine.tensor_parallel import TensorParallelError
from modelship.model.config import ModelConfig
from modelship.model.tensor_parallel import ShardSpec
from paged_model import engine_prefill_logits

from server_process import ServerProcess
from tiny_models import make_tiny_llama

CONFIG = dict(dtype="float32", block_size=4, num_kv_blocks=64)


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 6 q heads over 3 kv heads, MLP 101 wide: neither divides by 2
    return make_tiny_llama(
        tmp_path_factory.mktemp("tp") / "model",
        hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=101,
    )  # fmt: skip


@pytest.fixture(scope="module")
def engines(uneven_dir: Path):
    one = LLMEngine(uneven_dir, EngineConfig(**CONFIG))
    two = LLMEngine(uneven_dir, EngineConfig(**CONFIG, tensor_parallel_size=2))
    yield one, two
    two.close()


def test_shards_split_by_whole_kv_head_groups(uneven_dir: Path) -> None:
    full = ModelConfig.from_dir(uneven_dir)
    shards = [ShardSpec(full, rank, 2) for rank in range(2)]
    assert [(s.kv_heads, s.q_heads, s.intermediate) for s in shards] == [
        ((0, 2), (0, 4), (0, 51)),
        ((2, 3), (4, 6), (51, 101)),
    ]
    assert shards[1].config.num_heads == 2 and shards[1].config.num_kv_heads == 1
    with pytest.raises(ValueError, match="--tensor-parallel-size 4 exceeds the model's 3 kv"):
        ShardSpec(full, 0, 4)


def test_logits_equal_one_rank(engines) -> None:
    one, two = engines
    prompts = [list(range(3, 30)), list(range(40, 47))]
    expected, got = engine_prefill_logits(one, prompts), engine_prefill_logits(two, prompts)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_greedy_generation_equals_one_rank(engines) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for engine in engines:
        for i, prompt in enumerate(([5, 6, 7, 8], list(range(60, 75)))):
            engine.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        outputs.append(tokens)
    assert outputs[0] == outputs[1] and all(len(t) == 8 for t in outputs[0].values())


def test_quantized_checkpoints_are_refused(uneven_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "q"
    shutil.copytree(uneven_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 supports dense checkpoints"):
        LLMEngine(copy, EngineConfig(**CONFIG, tensor_parallel_size=2))


def test_a_dead_worker_fails_the_engine(engines) -> None:  # last: it breaks the fixture
    _, two = engines
    worker = two.tp_group.workers[0]
    worker.kill()
    worker.join(10)
    two.add_request("after", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
    with pytest.raises(TensorParallelError, match=r"rank 1 \(exit code -9\) died"):
        two.step()


def test_serve_at_tp2_answers_the_openai_sdk_and_exits_when_a_rank_dies(
    uneven_dir: Path, engines
) -> None:
    one, _ = engines
    server = ServerProcess(
        uneven_dir, "--served-model-name", "tiny", "--dtype", "float32",
        "--tensor-parallel-size", "2", "--engine-core", "process",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        reply = client.completions.create(
            model="tiny", prompt=[5, 6, 7, 8], max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        one.add_request("serve", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6,
                                                             ignore_eos=True))  # fmt: skip
        expected = []
        while one.has_unfinished():
            expected += [t for d in one.step() for t in d.token_ids]
        assert reply.choices[0].text == one.tokenizer.decode(expected)
        # server -> engine core (rank 0) -> rank 1
        (core,) = _children(server.pid)
        (rank1,) = _children(core, "spawn_main")
        os.kill(rank1, 9)
        with pytest.raises(openai.APIError):
            client.completions.create(model="tiny", prompt="x", max_tokens=4, timeout=60)
        deadline = time.monotonic() + 60
        while not server.has_exited() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.has_exited() and server.process.returncode != 0
        assert "tensor-parallel rank 1 (exit code -9) died" in server.log()
    finally:
        server.kill()
        server.close_log()


def _children(pid: int, command: str = "") -> list[int]:
    """Child processes of `pid` whose command line contains `command`."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    pids = [int(child) for child in text.split()]
    return [p for p in pids if command in Path(f"/proc/{p}/cmdline").read_text()]


def test_the_option_reaches_serve_flags_and_the_engine_config() -> None:
    import typer

    from modelship.cli.serve import app as serve_app
    from modelship.engine.options import EngineOptions

    options = EngineOptions(tensor_parallel_size=2)
    assert options.to_engine_config().tensor_parallel_size == 2
    context = typer.main.get_command(serve_app).make_context("serve", ["m", *options.cli_args()])
    assert context.params["tensor_parallel_size"] == 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(tensor_parallel_size=0)
