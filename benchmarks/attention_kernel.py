"""Decode attention on the CPU kernel (`paged_attention`, `csrc/attention_cpu.cpp`) against
the machine's memory read bandwidth: the attention row of docs/performance.md's roofline.

    .venv/bin/python benchmarks/attention_kernel.py [--contexts 256 1024] [--batch 1 16]
                                                    [--threads 1] [--repeats 10] [--out FILE]

The demo model's attention (9 query heads, 3 KV heads of 64, block size 16): each of
`--batch` requests decodes one token over a context of L positions, in each of 30 layers
whose KV caches are distinct tensors (so a sweep reads them from memory, as a decode step
does); the time per layer is the sweep's minimum over `--repeats` divided by 30. Bytes: the
K and V read (fp32: 1.5 KB per position; int8: 384 B plus 24 B of scales), MACs: q.k and
p.v, 2 x 9 x 64 per position. Printed against the read bandwidth (a sum over a 512 MB fp32
tensor); the machine may be shared: the load average is printed with the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from modelship.model import cpu_kernels
from modelship.model.kv_cache import quantize_kv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from q4_gemm import best_of

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 30
STREAM_BYTES = 512 << 20


def random_cache(
    num_slots: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[num_slots, 2, KV_HEADS, HEAD_DIM] fp32, or int8 with its scales [num_slots, 2, KV_HEADS]."""
    kv = torch.randn(num_slots, 2, KV_HEADS, HEAD_DIM, generator=gen)
    if dtype == torch.float32:
        return kv, None
    return quantize_kv(kv)


def time_decode(
    context: int, batch: int, dtype: torch.dtype, repeats: int, gen: torch.Generator
) -> float:
    """Seconds per layer: `batch` one-token queries over `context` positions each."""
    blocks_per_request = -(-context // BLOCK_SIZE)
    num_slots = batch * blocks_per_request * BLOCK_SIZE
    caches = [random_cache(num_slots, dtype, gen) for _ in range(NUM_LAYERS)]
    block_table = torch.arange(batch * blocks_per_request, dtype=torch.int32).view(batch, -1)
    token_request = torch.arange(batch, dtype=torch.int32)
    token_position = torch.full((batch,), context - 1, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5

    def sweep() -> None:
        for kv, kv_scales in caches:
            cpu_kernels.paged_attention(
                q, kv, kv_scales, block_table, token_request, token_position, BLOCK_SIZE, scale
            )

    return best_of(repeats, sweep) / NUM_LAYERS


def bytes_per_position(dtype: torch.dtype) -> int:
    values = 2 * KV_HEADS * HEAD_DIM * (4 if dtype == torch.float32 else 1)
    return values + (0 if dtype == torch.float32 else 2 * KV_HEADS * 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/attention.json"))
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("modelship's CPU kernels are unavailable on this machine")
    loadavg_before = Path("/proc/loadavg").read_text().split()[:3]
    gen = torch.Generator().manual_seed(0)
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        stream = torch.ones(STREAM_BYTES // 4)
        bandwidth = STREAM_BYTES / best_of(args.repeats, stream.sum)
        del stream
        print(f"{threads} thread(s): read bandwidth {bandwidth / 1e9:.1f} GB/s")
        print(f"{'cache':<8}{'L':>6}{'batch':>6}{'us/layer':>10}{'GB/s':>8}{'bw':>6}{'GMAC/s':>8}")
        for dtype in (torch.float32, torch.int8):
            for context in args.contexts:
                for batch in args.batch:
                    seconds = time_decode(context, batch, dtype, args.repeats, gen)
                    num_bytes = batch * context * bytes_per_position(dtype)
                    macs = batch * context * 2 * HEADS * HEAD_DIM
                    name = str(dtype).removeprefix("torch.")
                    results.append(
                        {
                            "cache": name,
                            "context": context,
                            "batch": batch,
                            "threads": threads,
                            "seconds_per_layer": seconds,
                            "bytes": num_bytes,
                            "macs": macs,
                            "bandwidth_bytes_per_s": bandwidth,
                        }
                    )
                    print(
                        f"{name:<8}{context:>6}{batch:>6}{seconds * 1e6:>10.1f}"
                        f"{num_bytes / seconds / 1e9:>8.1f}{num_bytes / seconds / bandwidth:>6.0%}"
                        f"{macs / seconds / 1e9:>8.1f}"
                    )
    loadavg_after = Path("/proc/loadavg").read_text().split()[:3]
    print(f"load average before {' '.join(loadavg_before)}, after {' '.join(loadavg_after)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    document = {"loadavg_before": loadavg_before, "loadavg_after": loadavg_after, "runs": results}
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
