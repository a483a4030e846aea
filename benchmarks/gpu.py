"""GPU benchmark: modelship vs transformers on random models of real shapes (issue 15).

    PYTHONPATH=src python benchmarks/gpu.py [--quick] [--requests N] [--out FILE]
    PYTHONPATH=src python benchmarks/gpu.py --device cpu --tiny   # the whole script, small

Needs only torch, transformers and this repository's source (tokenizers, safetensors and
jinja2 come with them): nothing is downloaded. Two models are built with random weights,
a Llama-3.2-1B shape in bf16 (speed) and SmolLM2-135M's shape in fp32 (parity), with a
word-level tokenizer over their vocabulary (`gpu_models.py`); prompts are seeded random
token ids.

1. parity: greedy tokens of modelship and transformers `generate`, fp32, 6 prompts.
2. throughput: 256 requests, prompts of 64-512 tokens, 128 output tokens each (EOS
   ignored): modelship `LLM` vs transformers static batches of 64 (left padded) vs
   transformers continuous batching (`generate_batch`, paged attention).
3. batch-1 decode ms/token (128-token prompt, 256 new tokens): modelship vs transformers
   eager vs transformers with a static cache, compiled.
4. int4: the 1B shape as a compressed-tensors W4A16 checkpoint (round-to-nearest, group 128,
   written as llm-compressor writes it), batch-1 and throughput vs bf16 in modelship.

Every section records its error in the JSON and the run goes on. `--tiny` shrinks both
shapes (hidden 128, 2 layers) so the script runs end to end on a CPU (fp32 there, no
compiled variant) with `--quick`'s shorter workload. Prints one table and writes JSON
(default benchmarks/results/gpu.json).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import platform
import random
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpu_models import (
    LLAMA_1B,
    PAD_ID,
    SMOLLM2_135M,
    SPECIAL_TOKENS,
    TINY,
    build_model,
    write_w4a16_checkpoint,
)
from modelship.engine import LLM, SamplingParams


# Workloads and timing ----------------------------------------------------------------------
def random_prompts(num: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    first = len(SPECIAL_TOKENS)
    return [
        [rng.randrange(first, vocab) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num)
    ]


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_hf(folder: Path, dtype: torch.dtype, device: str, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).to(device).eval()


def modelship_llm(folder: Path, args, **config) -> LLM:
    if torch.device(args.device).type == "cuda":
        config.setdefault("kv_cache_memory_bytes", int(args.kv_cache_gib * 1024**3))
    return LLM(folder, device=args.device, max_num_seqs=args.max_num_seqs, **config)


# Sections ----------------------------------------------------------------------------------
def bench_parity(folder: Path, args) -> dict:
    """Greedy tokens, one prompt at a time, both systems in fp32 on the device."""
    prompts = random_prompts(6, 16, 64, args.shapes["parity"]["vocab_size"], args.seed + 1)
    num_tokens = 32
    llm = modelship_llm(folder, args, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=num_tokens)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    del llm
    free_memory()
    model = load_hf(folder, torch.float32, args.device)
    theirs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=args.device)
            out = model.generate(ids, max_new_tokens=num_tokens, do_sample=False)
            theirs.append(out[0, len(prompt) :].tolist())
    del model
    free_memory()
    matching = total = 0
    first_divergence = []
    for a, b in zip(ours, theirs, strict=True):
        total += max(len(a), len(b))
        same = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        matching += same
        first_divergence.append(same if same < max(len(a), len(b)) else None)
    return {
        "prompts": len(prompts),
        "max_tokens": num_tokens,
        "matching_tokens": matching,
        "total_tokens": total,
        "identical": matching == total,
        "first_divergence": first_divergence,
    }


def bench_modelship(folder: Path, args, prompts, num_tokens: int, **config) -> dict:
    llm = modelship_llm(folder, args, **config)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    # A workload of the same shape with other prompts runs first (other prompts, so the
    # timed run gets no prefix-cache hits from it): Triton specializes and compiles its
    # kernels per batch size and argument alignment the first time it meets them, and a
    # short warm-up covers few of them. On a fresh H200 the first pass of the 256-request
    # workload ran at 5,834 tok/s and later passes at ~9,300 (docs/performance.md); the
    # cold pass is kept in the JSON.
    vocab = args.shapes["speed"]["vocab_size"]
    warmup = random_prompts(len(prompts), 64, 512, vocab, args.seed + 1000)
    cold = timed_generate(llm, warmup, params, args.device)
    result = timed_generate(llm, prompts, params, args.device)
    result["cold_output_tok_s"] = cold["output_tok_s"]
    result["weight_bytes"] = llm.engine.weight_bytes()
    model = llm.engine.model
    result["dtype"] = str(model.dtype).removeprefix("torch.")
    result["qkv_linear"] = type(model.layers[0].qkv_proj).__name__  # which int4 path ran
    result["decode"] = decode_modelship(llm, args)
    del llm
    free_memory()
    return result


def timed_generate(llm: LLM, prompts, params: SamplingParams, device: str) -> dict:
    sync(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "output_tokens": generated, "output_tok_s": generated / seconds}


def decode_modelship(llm: LLM, args) -> dict:
    """Median wall time of one decode step, batch 1, after the prefill step."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    engine.add_request("decode", decode_prompt(args), params)
    times = []
    while engine.has_unfinished():
        engine.step()
        times.append(time.perf_counter())
    steps = [b - a for a, b in itertools.pairwise(times[1:])]
    return {"ms_per_token": statistics.median(steps) * 1e3, "new_tokens": args.decode_tokens}


def decode_prompt(args) -> list[int]:
    vocab = args.shapes["speed"]["vocab_size"]
    return random_prompts(1, 128, 128, vocab, args.seed + 2)[0]


def bench_hf_static(folder: Path, args, prompts, num_tokens: int, dtype) -> dict:
    model = load_hf(folder, dtype, args.device)
    batch_size = args.hf_batch_size
    with torch.inference_mode():
        run_static_batch(model, prompts[:2], 4, args.device)  # warm-up
        sync(args.device)
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            run_static_batch(model, prompts[i : i + batch_size], num_tokens, args.device)
        sync(args.device)
        seconds = time.perf_counter() - start
    del model
    free_memory()
    useful = num_tokens * len(prompts)
    return {
        "seconds": seconds,
        "output_tokens": useful,
        "output_tok_s": useful / seconds,
        "batch_size": batch_size,
    }


def run_static_batch(model, batch: list[list[int]], num_tokens: int, device: str):
    width = max(len(p) for p in batch)
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        pad_token_id=PAD_ID,
    )


def bench_hf_generate_batch(folder: Path, args, prompts, num_tokens: int, dtype) -> dict:
    """transformers' continuous batching (paged attention); EOS disabled with id -1. Off
    CUDA its cache is sized explicitly (it would take 90% of the machine's memory)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = load_hf(folder, dtype, args.device, attn_implementation="paged|sdpa")
    config = GenerationConfig(
        max_new_tokens=num_tokens, do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID
    )
    cb_config = None
    if torch.device(args.device).type != "cuda":
        cb_config = ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=1024)
    kwargs = {"generation_config": config, "continuous_batching_config": cb_config}
    # No inference_mode here: the batching thread updates tensors made on this thread in place.
    model.generate_batch(inputs=prompts[:2], **kwargs)  # warm-up
    sync(args.device)
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, **kwargs)
    sync(args.device)
    seconds = time.perf_counter() - start
    errors = [o.error for o in outputs.values() if o.error is not None]
    if errors or len(outputs) != len(prompts):
        raise RuntimeError(
            f"{len(prompts) - len(outputs) + len(errors)} requests failed: {errors[:1]}"
        )
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    result = {"seconds": seconds, "output_tokens": generated, "output_tok_s": generated / seconds}
    if generated != num_tokens * len(prompts):
        result["note"] = f"{generated} of {num_tokens * len(prompts)} tokens generated"
    return result


def bench_hf_decode(folder: Path, args, dtype, compiled: bool) -> dict:
    """Median wall time between new tokens at batch 1 (after the first, the prefill), read
    from a streamer: the same measure as modelship's step time."""
    from transformers import CompileConfig
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        """`put` gets the prompt, then each new token (already copied to the CPU)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    model = load_hf(folder, dtype, args.device)
    ids = torch.tensor([decode_prompt(args)], device=args.device)
    extra: dict[str, Any] = {}
    if compiled:
        extra = {"cache_implementation": "static", "compile_config": CompileConfig()}
    n = args.decode_tokens
    medians = []
    with torch.inference_mode():
        for _ in range(3 if compiled else 2):  # the first runs compile and capture graphs
            clock = StepClock()
            model.generate(
                ids,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=PAD_ID,
                streamer=clock,
                **extra,
            )
            steps = [b - a for a, b in itertools.pairwise(clock.times[2:])]
            medians.append(statistics.median(steps))
    return {"ms_per_token": medians[-1] * 1e3, "new_tokens": n}


# Orchestration -----------------------------------------------------------------------------
def section(results: dict, name: str, fn: Callable[[], dict]) -> None:
    """Run one measurement; its error goes into the results instead of ending the run."""
    print(f"-- {name} ...", flush=True)
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:  # a benchmark records what failed and goes on
        results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        traceback.print_exc()
    free_memory()  # the section's models are garbage now
    results[name]["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"   {name}: {json.dumps(results[name])[:300]}", flush=True)


def run(args) -> dict:
    on_cuda = torch.device(args.device).type == "cuda"
    speed_dtype = torch.bfloat16 if on_cuda else torch.float32
    speed_dtype_name = str(speed_dtype).removeprefix("torch.")
    results: dict[str, Any] = {"settings": settings(args, speed_dtype_name)}
    workdir = Path(tempfile.mkdtemp(prefix="modelship-gpu-bench-"))
    print(f"models in {workdir}", flush=True)
    parity_dir, speed_dir = workdir / "parity-fp32", workdir / "speed"
    int4_dir = workdir / "speed-w4a16"
    shapes = args.shapes

    section(
        results,
        "build",
        lambda: {
            "parity": str(build_model(parity_dir, shapes["parity"], torch.float32, args.device, 0)),
            "speed": str(build_model(speed_dir, shapes["speed"], speed_dtype, args.device, 1)),
            "int4": str(write_w4a16_checkpoint(speed_dir, int4_dir, args.group_size)),
        },
    )
    prompts = random_prompts(args.requests, 64, 512, shapes["speed"]["vocab_size"], args.seed)
    n = args.output_tokens
    # fp32 on CPU (the engine would pick bf16 there); on CUDA the checkpoint's bf16
    dense = {} if on_cuda else {"dtype": "float32"}
    section(results, "parity", lambda: bench_parity(parity_dir, args))
    section(results, "modelship", lambda: bench_modelship(speed_dir, args, prompts, n, **dense))
    section(
        results,
        "transformers static",
        lambda: bench_hf_static(speed_dir, args, prompts, n, speed_dtype),
    )
    section(
        results,
        "transformers generate_batch",
        lambda: bench_hf_generate_batch(speed_dir, args, prompts, n, speed_dtype),
    )
    section(
        results,
        "transformers decode eager",
        lambda: bench_hf_decode(speed_dir, args, speed_dtype, compiled=False),
    )
    if on_cuda:
        section(
            results,
            "transformers decode compiled",
            lambda: bench_hf_decode(speed_dir, args, speed_dtype, compiled=True),
        )
    else:
        results["transformers decode compiled"] = {"error": "skipped: not on CUDA"}
    # On CPU the engine's default (bf16 on its int4 kernels) runs the int4 checkpoint.
    section(results, "modelship int4", lambda: bench_modelship(int4_dir, args, prompts, n))
    return results


def settings(args, speed_dtype: str) -> dict:
    import transformers

    device = args.device
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        device = f"{device} ({torch.cuda.get_device_name()})"
    return {
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "speed_shape": args.shapes["speed"],
        "parity_shape": args.shapes["parity"],
        "speed_dtype": speed_dtype,
        "requests": args.requests,
        "prompt_tokens": "64-512",
        "output_tokens": args.output_tokens,
        "decode_tokens": args.decode_tokens,
        "hf_batch_size": args.hf_batch_size,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_gib": args.kv_cache_gib,
        "int4_group_size": args.group_size,
        "seed": args.seed,
    }


# Report ------------------------------------------------------------------------------------
def value(results: dict, name: str, *keys: str) -> float | None:
    row: Any = results.get(name, {})
    for key in keys:
        if not isinstance(row, dict) or key not in row:
            return None
        row = row[key]
    return row


def cell(results: dict, name: str, *keys: str, fmt: str = "{:.1f}") -> str:
    v = value(results, name, *keys)
    if v is not None:
        return fmt.format(v)
    error = results.get(name, {}).get("error")
    return f"n/a: {error[:40]}" if error else "n/a"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def table(results: dict) -> list[tuple[str, ...]]:
    """Rows of (metric, modelship, transformers static / eager, transformers generate_batch /
    compiled, ratio)."""
    r = results
    parity = r.get("parity", {})
    parity_cell = (
        f"{parity['matching_tokens']}/{parity['total_tokens']} "
        + ("identical" if parity["identical"] else "differ")
        if "matching_tokens" in parity
        else cell(r, "parity", "matching_tokens")
    )
    tok_s = value(r, "modelship", "output_tok_s")
    hf_tok_s = [value(r, f"transformers {k}", "output_tok_s") for k in ("static", "generate_batch")]
    ms = value(r, "modelship", "decode", "ms_per_token")
    hf_ms = [value(r, f"transformers decode {k}", "ms_per_token") for k in ("eager", "compiled")]
    int4_tok_s = value(r, "modelship int4", "output_tok_s")
    int4_ms = value(r, "modelship int4", "decode", "ms_per_token")
    gib = [value(r, k, "weight_bytes") for k in ("modelship", "modelship int4")]
    ms_fmt = "{:.2f}"
    return [
        ("greedy parity, fp32 (tokens)", parity_cell, "reference", "", ""),
        (
            "throughput (output tok/s)",
            cell(r, "modelship", "output_tok_s"),
            cell(r, "transformers static", "output_tok_s"),
            cell(r, "transformers generate_batch", "output_tok_s"),
            ratio(tok_s, max(filter(None, hf_tok_s), default=None)) + " best HF",
        ),
        (
            "batch-1 decode (ms/token)",
            cell(r, "modelship", "decode", "ms_per_token", fmt=ms_fmt),
            cell(r, "transformers decode eager", "ms_per_token", fmt=ms_fmt),
            cell(r, "transformers decode compiled", "ms_per_token", fmt=ms_fmt),
            ratio(min(filter(None, hf_ms), default=None), ms) + " best HF",
        ),
        (
            "int4 throughput (output tok/s)",
            cell(r, "modelship int4", "output_tok_s"),
            "",
            "",
            ratio(int4_tok_s, tok_s) + " dense",
        ),
        (
            "int4 batch-1 decode (ms/token)",
            cell(r, "modelship int4", "decode", "ms_per_token", fmt=ms_fmt),
            "",
            "",
            ratio(ms, int4_ms) + " dense",
        ),
        (
            "weights in memory (GiB): dense, int4",
            ", ".join(f"{b / 1024**3:.3f}" if b else "n/a" for b in gib),
            "",
            "",
            ratio(gib[0], gib[1]) + " smaller",
        ),
    ]


def print_table(rows) -> None:
    header = ("metric", "modelship", "HF static / eager", "HF gen_batch / compiled", "ratio")
    widths = [max(len(str(row[i])) for row in [header, *rows]) + 2 for i in range(5)]
    for row in [header, *rows]:
        print("".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--tiny", action="store_true", help="hidden 128, 2 layers, 32 quick requests (CPU)"
    )
    parser.add_argument("--quick", action="store_true", help="64 requests, 32 output tokens")
    parser.add_argument("--requests", type=int, help="default 256 (--quick 64, --tiny 32)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="modelship batch limit")
    parser.add_argument("--kv-cache-gib", type=float, default=8.0, help="modelship, CUDA")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu.json"))
    args = parser.parse_args()
    args.quick = args.quick or args.tiny
    args.requests = args.requests or (32 if args.tiny else 64 if args.quick else 256)
    args.output_tokens = 32 if args.quick else 128
    args.decode_tokens = 64 if args.quick else 256
    if args.tiny:
        args.shapes = {"speed": TINY, "parity": TINY | {"num_hidden_layers": 3}}
    else:
        args.shapes = {"speed": LLAMA_1B, "parity": SMOLLM2_135M}

    results = run(args)
    rows = table(results)
    print()
    print_table(rows)
    results["table"] = [list(row) for row in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
