"""Mixture-of-experts layers in the fused CPU decoder (`csrc/moe_cpu.cpp`): the same logits as
transformers and as the layer-by-layer path, and a request's greedy tokens the same alone
or in a batch."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from modelship import LLM, SamplingParams
from modelship.model import cpu_kernels, load_model
from paged_model import random_ids, run

from tiny_models import save_tiny_moe

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="needs AVX2 and a compiler")

CASES = [
    ("mixtral", {}),
    ("olmoe", {"norm_topk_prob": True, "clip_qkv": 0.5}),  # q/k norm over the whole projection
    ("qwen2_moe", {}),  # q/k/v bias, the sigmoid-gated shared expert
    # per-head q/k norm, a dense layer between routed ones, top-k renormalized
    ("qwen3_moe", {"norm_topk_prob": True, "mlp_only_layers": [1], "num_hidden_layers": 3}),
]
TABLE = [11, 3, 8, 0, 6, 2, 14, 9, 1, 20]


@pytest.mark.parametrize(("kind", "overrides"), CASES)
def test_fused_logits_equal_transformers_and_the_unfused_path(
    kind: str, overrides: dict, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny_moe(kind, tmp_path / kind, **overrides)
    model = load_model(folder, dtype=torch.float32)
    assert model.fused_decoder is not None  # the default on an AVX2 CPU, routed layers too
    ids = random_ids(37, model.config.vocab_size)
    # a prefill in two chunks, then decode one token at a time
    steps = [(ids[:9], 0), (ids[9:30], 9), *[(ids[i : i + 1], i) for i in range(30, 37)]]
    fused = run(model, steps, TABLE, "cpu")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(fused, expected, atol=1e-4, rtol=1e-4)
    model.fused_decoder = None
    unfused = run(model, steps, TABLE, "cpu")
    torch.testing.assert_close(fused, unfused, atol=1e-4, rtol=1e-4)
    assert torch.equal(fused.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("kind", ["olmoe", "qwen2_moe"])
def test_greedy_is_the_same_alone_and_in_a_batch(kind: str, tmp_path: Path) -> None:
    """bf16 compute (the CPU default): a request's tokens and logprobs, bit for bit, alone
    and sharing its steps with other requests' prefills and decodes."""
    folder = save_tiny_moe(kind, tmp_path / kind)
    llm = LLM(folder, block_size=4, num_kv_blocks=256)
    assert llm.engine.model.fused_decoder is not None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    vocab = llm.engine.model.config.vocab_size
    prompt = random_ids(23, vocab, seed=5).tolist()
    others = [random_ids(n, vocab, seed=10 + n).tolist() for n in (3, 17, 9, 30, 5)]

    def tokens_and_logprobs(output) -> list[tuple[int, float]]:
        completion = output.outputs[0]
        pairs = zip(completion.token_ids, completion.logprobs, strict=True)
        return [(t, lp.logprob) for t, lp in pairs]

    alone = tokens_and_logprobs(llm.generate(prompt, params)[0])
    in_batch = tokens_and_logprobs(llm.generate([*others[:2], prompt, *others[2:]], params)[2])
    assert len(alone) == 12
    assert in_batch == alone


def test_an_expert_parallel_share_keeps_the_layer_by_layer_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = save_tiny_moe("olmoe", tmp_path / "o")
    model = load_model(folder, dtype=torch.float32, fused_decoder=False)
    model.layers[1].mlp.local_experts = (0, 3)  # half of the 6 experts: not in the op
    with caplog.at_level(logging.INFO, logger="modelship.model.llama"):
        assert not model.use_fused_decoder()
    assert model.fused_decoder is None
    assert "layers [1] are outside the fused CPU decoder" in caplog.text
