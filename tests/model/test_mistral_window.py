"""Mistral v0.1-style sliding windows (`sliding_window` in config.json, every layer) against
transformers on tiny random weights: logits through the paged cache on each backend, and a
generation far longer than the window on a KV cache too small to hold it, whose blocks
before the window go back to the pool as it runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from modelship import LLM, SamplingParams
from modelship.model import load_model
from paged_model import BACKENDS, random_ids, run

from tiny_models import make_tokenizer, tiny_settings

WINDOW = 6


def save_tiny_mistral(folder: Path) -> Path:
    """A 2-layer random Mistral whose every layer sees the last 6 positions."""
    from transformers import MistralConfig, MistralForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder)
    config = MistralConfig(**tiny_settings(tokenizer, intermediate_size=128, sliding_window=WINDOW))
    torch.manual_seed(0)
    model = MistralForCausalLM(config)
    with torch.no_grad():  # sharper attention, so which keys a query sees shows in logits
        for name, param in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                param.mul_(8.0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def reference_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.mark.parametrize("backend", [*BACKENDS, "triton"])
def test_logits_match_transformers(backend: str, tmp_path: Path) -> None:
    folder = save_tiny_mistral(tmp_path / "m")
    model = load_model(folder, dtype=torch.float32)
    assert [layer.window for layer in model.layers] == [WINDOW, WINDOW]
    assert model.config.kv_window == WINDOW
    ids = random_ids(37, model.config.vocab_size)
    reference = reference_model(folder)
    with torch.no_grad():
        expected = reference(ids.unsqueeze(0)).logits[0]
        reference.config.sliding_window = None  # the window bites: without it, other logits
        unwindowed = reference(ids.unsqueeze(0)).logits[0]
    assert not torch.allclose(unwindowed[WINDOW:], expected[WINDOW:], atol=1e-3)
    if backend == "triton":  # the kernel on CPU tensors: Triton's interpreter, which
        pytest.importorskip("triton")  # conftest turns on where no GPU can run it
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("on a GPU, test_triton_attention.py::test_sliding_window runs it")
    steps = [(ids[:9], 0), (ids[9:30], 9), *[(ids[i : i + 1], i) for i in range(30, 37)]]
    chunked = run(model, steps, [11, 3, 8, 0, 6, 2, 14, 9, 1, 20], backend)
    torch.testing.assert_close(chunked, expected, atol=1e-4, rtol=1e-4)


def test_long_generation_frees_blocks_outside_the_window(tmp_path: Path) -> None:
    """70 tokens on a cache of 12 blocks of 4 (48 tokens): admitted and run only because the
    blocks before the window go back; greedy tokens equal transformers' `generate`, and a
    second run of the prompt still hits the prefix cache."""
    folder = save_tiny_mistral(tmp_path / "m")
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=12, max_num_batched_tokens=8)
    manager = llm.engine.block_manager
    assert manager.window == WINDOW
    prompt = "Continuous batching schedules requests at iteration granularity."
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    first = llm.generate(prompt, params)[0]
    prompt_ids = first.prompt_token_ids
    assert len(prompt_ids) + 60 > 12 * 4
    with torch.no_grad():
        generated = (
            reference_model(folder)
            .generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=60,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt_ids) :]
            .tolist()
        )
    assert first.outputs[0].token_ids == generated
    manager.check_integrity()
    assert manager.num_free_blocks == 12
    second = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert second[0].outputs[0].token_ids == generated[:4]
