"""The newer architectures (mixture-of-experts, Phi-3, Gemma 2/3) on a GPU: the engine's
greedy tokens on CUDA equal transformers' `generate` on the same device, in fp32 (exact
kernels on both sides) and through the default CUDA path (Triton attention, CUDA graphs
where the model allows them). Skipped without a GPU; the CPU twins are test_moe.py,
test_phi3.py and test_gemma.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_phi3 import save_tiny_phi3

from modelship import LLM, SamplingParams

from tiny_models import save_tiny_gemma2, save_tiny_moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BUILDERS = {
    "mixtral": lambda folder: save_tiny_moe("mixtral", folder),
    "olmoe": lambda folder: save_tiny_moe("olmoe", folder),
    "qwen3_moe": lambda folder: save_tiny_moe("qwen3_moe", folder),
    "qwen2_moe": lambda folder: save_tiny_moe("qwen2_moe", folder),
    "phi3": save_tiny_phi3,
    "gemma2": lambda folder: save_tiny_gemma2(folder, "gemma2"),
    "gemma3": lambda folder: save_tiny_gemma2(folder, "gemma3"),
}
PROMPTS = [
    "Continuous batching schedules requests at iteration granularity. " * 2,
    "A paged cache",
    "Experts are chosen per token by a router; " * 3,
]


def reference_tokens(folder: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    # eager: transformers' SDPA path cannot soft-cap Gemma 2's attention scores
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).to("cuda")
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids], device="cuda"),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_greedy_on_cuda_equals_transformers(kind: str, tmp_path: Path) -> None:
    folder = BUILDERS[kind](tmp_path / kind)
    llm = LLM(folder, device="cuda", dtype="float32", block_size=16, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = llm.generate(PROMPTS, params)  # one batch: prefill together, decode together
    for prompt, result in zip(PROMPTS, batched, strict=True):
        expected = reference_tokens(folder, result.prompt_token_ids, 12)
        assert result.outputs[0].token_ids == expected, prompt
    again = llm.generate(PROMPTS[0], params)[0]  # its blocks come from the prefix cache
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == batched[0].outputs[0].token_ids


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_bf16_default_path_runs_and_mostly_agrees(kind: str, tmp_path: Path) -> None:
    """bf16 with the default attention backend and CUDA graphs where the model takes them:
    it runs, and its first greedy tokens mostly agree with fp32 (bf16 rounding may flip a
    near-tie later on)."""
    folder = BUILDERS[kind](tmp_path / kind)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    exact = LLM(folder, device="cuda", dtype="float32").generate(PROMPTS, params)
    fast = LLM(folder, device="cuda", dtype="bfloat16").generate(PROMPTS, params)
    agree = sum(
        a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        for a, b in zip(exact, fast, strict=True)
    )
    assert agree >= 2
    assert all(len(r.outputs[0].token_ids) == 8 for r in fast)
