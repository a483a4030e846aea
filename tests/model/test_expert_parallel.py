"""Expert parallelism on 2 CPU ranks (gloo): each rank holds half of every routed layer's
experts (and half of Qwen2-MoE's shared expert), attention stays tensor-parallel, one
all-reduce per layer sums the experts' shares; logits and greedy tokens equal one rank's,
and `modelship serve --expert-parallel` serves the same text."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch

from modelship import SamplingParams
from modelship.engine.config import EngineConfig
from modelship.engine.llm_engine import LLMEngine
from modelship.model.config import ModelConfig
from modelship.model.tensor_parallel import ShardSpec
from paged_model import engine_prefill_logits

from server_process import ServerProcess
from tiny_models import save_tiny_moe

CONFIG = dict(dtype="float32", block_size=4, num_kv_blocks=64)
CASES = {
    "qwen2_moe": {},  # q/k/v bias, the sigmoid-gated shared expert
    "qwen3_moe": {"mlp_only_layers": [1], "num_hidden_layers": 3},  # a dense layer between
}


@pytest.fixture(scope="module", params=sorted(CASES))
def engines(request, tmp_path_factory: pytest.TempPathFactory):
    folder = save_tiny_moe(request.param, tmp_path_factory.mktemp("ep") / request.param,
                           **CASES[request.param])  # fmt: skip
    one = LLMEngine(folder, EngineConfig(**CONFIG))
    two = LLMEngine(folder, EngineConfig(**CONFIG, tensor_parallel_size=2, expert_parallel=True))
    yield folder, one, two
    two.close()


def test_shards_deal_whole_experts(tmp_path: Path) -> None:
    full = ModelConfig.from_dir(save_tiny_moe("qwen2_moe", tmp_path / "q"))  # 6 experts
    shards = [ShardSpec(full, rank, 2, expert_parallel=True) for rank in range(2)]
    assert [(s.experts, s.shared_intermediate, s.kv_heads) for s in shards] == [
        ((0, 3), (0, 40), (0, 1)),
        ((3, 6), (40, 80), (1, 2)),
    ]
    moe = shards[1].config.moe
    assert moe is not None and moe.local_experts == (3, 6) and moe.num_experts == 6
    assert moe.shared_intermediate_size == 40 and moe.intermediate_size == 48


def test_refusals_name_the_option(tmp_path: Path, tiny_llama_dir: Path) -> None:
    moe = ModelConfig.from_dir(save_tiny_moe("mixtral", tmp_path / "m"))  # 6 experts
    with pytest.raises(ValueError, match=r"--expert-parallel: 6 experts do not divide over "
                       r"--tensor-parallel-size 4 ranks"):  # fmt: skip
        ShardSpec(moe, 0, 4, expert_parallel=True)
    with pytest.raises(ValueError, match=r"tensor-parallel-size 2 shards mixture-of-experts "
                       r"models \(MixtralForCausalLM\) only with --expert-parallel"):  # fmt: skip
        ShardSpec(moe, 0, 2)
    with pytest.raises(ValueError, match="--expert-parallel needs a mixture-of-experts model; "
                       "LlamaForCausalLM is dense"):  # fmt: skip
        LLMEngine(tiny_llama_dir, EngineConfig(**CONFIG, expert_parallel=True))


def test_logits_and_greedy_tokens_equal_one_rank(engines) -> None:
    _, one, two = engines
    routed = [layer.mlp.inner for layer in two.model.inner.layers if hasattr(layer.mlp, "inner")]
    assert routed and all(len(mlp.experts) == 3 for mlp in routed)  # half of the 6 each
    prompts = [list(range(3, 30)), list(range(40, 47))]
    expected, got = engine_prefill_logits(one, prompts), engine_prefill_logits(two, prompts)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for engine in (one, two):
        for i, prompt in enumerate(([5, 6, 7, 8], list(range(60, 75)))):
            engine.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        outputs.append(tokens)
    assert outputs[0] == outputs[1] and all(len(t) == 8 for t in outputs[0].values())


def test_serve_with_expert_parallel_answers_like_transformers(tmp_path: Path) -> None:
    """`modelship serve --tensor-parallel-size 2 --expert-parallel` (Mixtral's w1/w2/w3
    expert names) greedy-decodes what transformers' `generate` does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = save_tiny_moe("mixtral", tmp_path / "m")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, 4:].tolist()  # fmt: skip
    server = ServerProcess(
        folder, "--served-model-name", "tiny", "--dtype", "float32",
        "--tensor-parallel-size", "2", "--expert-parallel", "--engine-core", "process",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        reply = client.completions.create(
            model="tiny", prompt=[5, 6, 7, 8], max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert reply.choices[0].text == AutoTokenizer.from_pretrained(folder).decode(generated)
    finally:
        server.kill()
        server.close_log()
