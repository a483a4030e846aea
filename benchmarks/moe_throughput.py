"""Mixture-of-experts decode throughput: a random-weight OLMoE-shaped model against a dense
model with the same active parameters, on modelship and transformers.

    .venv/bin/python benchmarks/engine_throughput.py --model moe [--moe-layers 2] [--moe-scale 2]

OLMoE-1B-7B's shape (64 experts, top-8, expert width 1024, hidden 2048, 16 heads of 128,
vocab 50304) with `--moe-layers` layers and the widths divided by `--moe-scale` (the
default fits a 2-core, 23 GB machine shared with other work). The dense twin has the same
attention and one gated MLP of width top_k x expert width: the same parameters active per
token (the router's 64 x hidden aside). For each model and batch size (1 and 16), greedy
requests of 32 random prompt tokens generate `--new-tokens` tokens each; tok/s = generated
tokens / wall time (prefill included, the same for both systems). modelship computes in
bf16, transformers in fp32 (its bf16 CPU path is slower on CPUs without native bf16).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

OLMOE = dict(
    hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
    num_experts_per_tok=8, intermediate_size=1024, vocab_size=50304,
)  # fmt: skip


def save_models(folder: Path, num_layers: int, scale: int) -> tuple[Path, Path]:
    """(moe, dense) random-weight checkpoints with a byte-level tokenizer, in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        PreTrainedTokenizerFast,
    )

    hidden, width = OLMOE["hidden_size"] // scale, OLMOE["intermediate_size"] // scale
    heads = OLMOE["num_attention_heads"] // scale
    common = dict(
        vocab_size=OLMOE["vocab_size"], hidden_size=hidden, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )  # fmt: skip
    top_k = OLMOE["num_experts_per_tok"]
    moe = OlmoeForCausalLM(OlmoeConfig(**common, intermediate_size=width, num_experts_per_tok=top_k,
                                       num_experts=OLMOE["num_experts"]))  # fmt: skip
    dense = LlamaForCausalLM(LlamaConfig(**common, intermediate_size=top_k * width))
    vocab = {f"<{i}>": i for i in range(OLMOE["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<1>", pad_token="<0>")
    paths = folder / "moe", folder / "dense"
    for model, path in zip((moe, dense), paths, strict=True):
        model.save_pretrained(path)
        fast.save_pretrained(path)
    return paths


def active_parameters(path: Path) -> int:
    """Parameters one token's forward multiplies by, embeddings and head aside."""
    from modelship.model.config import ModelConfig

    c = ModelConfig.from_dir(path)
    attention = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    if c.moe is not None:
        mlp = 3 * c.hidden_size * c.moe.intermediate_size * c.moe.top_k
        mlp += c.hidden_size * c.moe.num_experts  # the router
    return c.num_layers * (attention + mlp)


def prompts(batch: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(2, vocab, (batch, 32), generator=gen).tolist()


def modelship_tok_s(path: Path, batch: int, new_tokens: int) -> float:
    from modelship.engine import LLM, SamplingParams

    llm = LLM(path, max_model_len=256, max_num_seqs=batch)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts(batch, 1000), SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts(batch, OLMOE["vocab_size"]), params)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def transformers_tok_s(path: Path, batch: int, new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts(batch, OLMOE["vocab_size"]))
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)  # fmt: skip
    return batch * new_tokens / (time.perf_counter() - start)


def run(folder: Path, num_layers: int, scale: int, new_tokens: int, batches: list[int]) -> dict:
    """The table's rows: {system: {batch: tok/s}}, plus the models' active parameters."""
    moe, dense = save_models(folder, num_layers, scale)
    results: dict = {"active_parameters": {"moe": active_parameters(moe),
                                           "dense": active_parameters(dense)}}  # fmt: skip
    for name, path in (("moe", moe), ("dense", dense)):
        for system, measure in (
            ("modelship", modelship_tok_s),
            ("transformers", transformers_tok_s),
        ):
            row = results.setdefault(f"{system} {name}", {})
            for batch in batches:
                print(f"{system} {name} batch {batch} ...", flush=True)
                row[batch] = measure(path, batch, new_tokens)
    return results


def print_table(results: dict, batches: list[int]) -> None:
    print(f"active parameters: {results['active_parameters']}")
    print(f"{'system':<22}" + "".join(f"{f'batch {b} tok/s':>16}" for b in batches))
    for name, row in results.items():
        if isinstance(row, dict) and name != "active_parameters":
            print(f"{name:<22}" + "".join(f"{row[b]:>16.1f}" for b in batches))
    for system in ("modelship", "transformers"):
        ratios = ", ".join(
            f"batch {b}: {results[f'{system} dense'][b] / results[f'{system} moe'][b]:.2f}x"
            for b in batches
        )
        print(f"{system}: dense tok/s / MoE tok/s = {ratios} (target at batch 1: <= 1.5x)")
    for name in ("moe", "dense"):
        ours, theirs = results[f"modelship {name}"], results[f"transformers {name}"]
        ratios = ", ".join(f"batch {b}: {ours[b] / theirs[b]:.2f}x" for b in batches)
        print(f"{name}: modelship / transformers = {ratios}")
