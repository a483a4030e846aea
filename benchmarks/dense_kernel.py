"""The dense CPU kernel (`dense_linear`, `csrc/dense_cpu.cpp`) on the demo model's shapes,
against the machine's memory bandwidth and per projection.

    .venv/bin/python benchmarks/dense_kernel.py [--rows 1 4 16 128] [--threads 2]
        [--isa auto avx2] [--repeats 5] [--out dense.json]

One "pass" is what a decode step of the fp16 variant multiplies: 30 layers of q/k/v
(960 x 576), o (576 x 576), gate/up (3072 x 576) and down (576 x 1536), and the tied
49152 x 576 head, all bf16 (269 MB). Per row count, thread count and kernel (`--isa`:
"auto" is what serving runs, "avx2" the AVX2-only tiles, the same bits), prints each
projection's time (its 30 distinct copies run back to back, so none is served from cache;
per copy), GFLOP/s and GB/s of weights read, then the whole pass next to the
bytes-over-bandwidth bound (bandwidth: the minimum time of a sum over a 269 MB fp32
buffer, same threads). Times are minima over `--repeats`; the machine is shared: compare
minima of side-by-side runs. Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from modelship.model import cpu_kernels

PROJECTIONS = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
}
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
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--isa", nargs="+", default=["auto"], choices=["auto", "avx2"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("modelship's CPU kernels are unavailable on this machine")

    weights = {  # distinct copies: no reuse from cache
        name: [torch.randn(shape).to(torch.bfloat16) for _ in range(NUM_LAYERS)]
        for name, shape in PROJECTIONS.items()
    }
    weights["head"] = [torch.randn(HEAD_SHAPE).to(torch.bfloat16)]
    pass_bytes = sum(w.numel() * w.element_size() for ws in weights.values() for w in ws)
    stream = torch.ones(pass_bytes // 4)  # fp32, the same number of bytes
    results = []
    print(f"{'rows':>5}{'thr':>4}{'isa':>6}{'proj':>9}{'ms':>10}{'GFLOP/s':>9}{'GB/s':>7}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidth = pass_bytes / best_of(args.repeats, stream.sum)
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k) for k in (576, 1536)}
            for isa in args.isa:
                pass_ms = 0.0
                for name, copies in weights.items():
                    n, k = copies[0].shape

                    def run(copies: list[torch.Tensor] = copies, x=inputs[k], isa=isa) -> None:
                        for w in copies:
                            cpu_kernels.dense_linear(x, w, None, isa=isa)

                    seconds = best_of(args.repeats, run) / len(copies)
                    pass_ms += seconds * len(copies) * 1e3
                    row = {
                        "rows": rows,
                        "threads": threads,
                        "isa": isa,
                        "projection": name,
                        "shape": [n, k],
                        "ms": seconds * 1e3,
                        "gflop_s": 2 * rows * n * k / seconds / 1e9,
                        "weight_gb_s": 2 * n * k / seconds / 1e9,
                    }
                    results.append(row)
                    print(
                        f"{rows:>5}{threads:>4}{isa:>6}{name:>9}{row['ms']:>10.3f}"
                        f"{row['gflop_s']:>9.1f}{row['weight_gb_s']:>7.1f}"
                    )
                bound_ms = pass_bytes / bandwidth * 1e3
                results.append(
                    {
                        "rows": rows,
                        "threads": threads,
                        "isa": isa,
                        "projection": "pass",
                        "ms": pass_ms,
                        "bound_ms": bound_ms,
                        "stream_gb_s": bandwidth / 1e9,
                    }
                )
                print(
                    f"{rows:>5}{threads:>4}{isa:>6}{'pass':>9}{pass_ms:>10.2f}"
                    f"  bound {bound_ms:.2f} ms ({pass_ms / bound_ms:.2f}x)"
                )
    print(f"weights: {pass_bytes / 1e6:.0f} MB per pass")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
