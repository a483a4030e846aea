"""The dense CPU kernel (`dense_linear`, `csrc/dense_cpu.cpp`) on the demo model's shapes,
against the machine's memory bandwidth.

    .venv/bin/python benchmarks/dense_kernel.py [--rows 1 16] [--threads 1 2] [--repeats 10]

One "pass" is what a decode step of the fp16 variant multiplies: 30 layers of q/k/v
(960 x 576), o (576 x 576), gate/up (3072 x 576) and down (576 x 1536), and the tied
49152 x 576 head, all bf16 (269 MB). Prints, per row count and thread count, the minimum
over `--repeats` passes, the bytes-over-bandwidth bound next to it (bandwidth: the minimum
time of a sum over a 269 MB fp32 buffer, same threads) and the ratio. The machine is shared:
compare minima of side-by-side runs. Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from modelship.model import cpu_kernels

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS = 30
HEAD_SHAPE = (49152, 576)


def best_of(repeats: int, fn) -> float:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("modelship's CPU kernels are unavailable on this machine")

    shapes = [shape for _ in range(NUM_LAYERS) for shape in LAYER_SHAPES] + [HEAD_SHAPE]
    weights = [torch.randn(shape).to(torch.bfloat16) for shape in shapes]  # distinct: no reuse
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    stream = torch.ones(weight_bytes // 4)  # fp32, the same number of bytes
    results = []
    print(f"{'rows':>5}{'threads':>8}{'pass ms':>10}{'bound ms':>10}{'ratio':>8}{'GB/s':>8}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidth = weight_bytes / best_of(args.repeats, stream.sum)
        for rows in args.rows:
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

            def one_pass(inputs: dict[int, torch.Tensor] = inputs) -> None:
                for w in weights:
                    cpu_kernels.dense_linear(inputs[w.shape[1]], w, None)

            seconds = best_of(args.repeats, one_pass)
            bound = weight_bytes / bandwidth
            row = {
                "rows": rows,
                "threads": threads,
                "pass_ms": seconds * 1e3,
                "bound_ms": bound * 1e3,
                "stream_gb_s": bandwidth / 1e9,
            }
            results.append(row)
            print(
                f"{rows:>5}{threads:>8}{seconds * 1e3:>10.2f}{bound * 1e3:>10.2f}"
                f"{seconds / bound:>8.2f}{weight_bytes / seconds / 1e9:>8.1f}"
            )
    print(f"weights: {weight_bytes / 1e6:.0f} MB per pass")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
