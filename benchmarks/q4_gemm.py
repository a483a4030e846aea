"""The W4A8 kernel (`q4_linear`) against the machine's limits: the int8 dot-product peak and
the memory read bandwidth.

    .venv/bin/python benchmarks/q4_gemm.py [--rows 1 16 128] [--threads 1] [--repeats 20]
                                           [--isa auto] [--out FILE]

For each row count (1: a decode step alone; 16: 16 decoding streams; 128: a prefill chunk)
each projection of a demo-model layer (SmolLM2-135M: qkv 960 x 576, o 576 x 576, gate_up
3072 x 576, down 576 x 1536, group size 64) is called `--repeats` times and the minimum kept
(activation quantization included, fp32 in and out); "layer" is their sum. Printed per line:
ms, GMAC/s (MACs = rows x out x in), the share of the int8 peak (`int8_peak.py`: the best
of the kernel's instruction set on the same threads, e.g. vpdpbusd on zmm for "vnni"), and
the bytes the call moves (4-bit weights, fp16 scales and mins, fp32 activations in and
outputs out) per second against the read bandwidth (a sum over a 512 MB fp32 tensor, as
`dense_kernel.py` measures it).

One projection called again and again keeps its weights in L2/L3, which a decode step does
not: "layer, cold" sweeps 30 layers of distinct weights (60 MB, more than this machine's L3)
once per call and divides by 30, the figure to set against the bandwidth. The machine may be
shared: the load average before and after is printed and saved with the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from modelship.model import cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_peak import cpu_flags, cpu_model, measure_peaks, peak_kinds, peak_of_isa

PROJECTIONS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
NUM_LAYERS = 30
GROUP_SIZE = 64
STREAM_BYTES = 512 << 20


@dataclass(frozen=True)
class PackedWeight:
    """One projection in `q4_linear`'s layout."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))

    def clone(self) -> PackedWeight:
        return PackedWeight(self.qweight.clone(), self.scales.clone(), self.mins.clone())


@dataclass(frozen=True)
class Measurement:
    """One line of the table: `projection` is a PROJECTIONS name, "layer" or "layer, cold"."""

    projection: str
    rows: int
    threads: int
    seconds: float
    macs: int
    num_bytes: int
    peak_macs_per_s: float
    bandwidth_bytes_per_s: float

    @property
    def macs_per_s(self) -> float:
        return self.macs / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.num_bytes / self.seconds

    def as_json(self) -> dict:
        return {
            **asdict(self),
            "macs_per_s": self.macs_per_s,
            "share_of_peak": self.macs_per_s / self.peak_macs_per_s,
            "bytes_per_s": self.bytes_per_s,
            "share_of_bandwidth": self.bytes_per_s / self.bandwidth_bytes_per_s,
        }

    def line(self) -> str:
        return (
            f"{self.projection:<12}{self.rows:>5}{self.threads:>4}{self.seconds * 1e3:>9.3f}"
            f"{self.macs_per_s / 1e9:>9.1f}{self.macs_per_s / self.peak_macs_per_s:>8.1%}"
            f"{self.bytes_per_s / 1e9:>8.1f}{self.bytes_per_s / self.bandwidth_bytes_per_s:>7.0%}"
        )


def random_weight(out_features: int, in_features: int, gen: torch.Generator) -> PackedWeight:
    groups = in_features // GROUP_SIZE
    u = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
    scale = torch.rand(out_features, groups, generator=gen) * 0.05 + 0.01
    zero_point = torch.randint(-8, 8, (out_features, groups), generator=gen, dtype=torch.int32)
    return PackedWeight(*cpu_kernels.pack_q4(u, scale, zero_point))


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    fn()  # warm: allocations, first touch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def call_bytes(weight: PackedWeight, rows: int, out_features: int, in_features: int) -> int:
    return weight.num_bytes + 4 * rows * (in_features + out_features)


def time_layer(
    weights: dict[str, PackedWeight],
    rows: int,
    threads: int,
    repeats: int,
    isa: str,
    gen: torch.Generator,
    limits: tuple[float, float],
) -> list[Measurement]:
    """Each projection alone (weights warm in cache), then their sum as "layer"."""
    measurements = []
    for name, (out_features, in_features) in PROJECTIONS.items():
        x = torch.randn(rows, in_features, generator=gen)
        w = weights[name]
        seconds = best_of(
            repeats,
            lambda x=x, w=w: cpu_kernels.q4_linear(x, w.qweight, w.scales, w.mins, GROUP_SIZE, isa),
        )
        macs = rows * out_features * in_features
        num_bytes = call_bytes(w, rows, out_features, in_features)
        measurements.append(Measurement(name, rows, threads, seconds, macs, num_bytes, *limits))
    measurements.append(
        Measurement(
            "layer",
            rows,
            threads,
            sum(m.seconds for m in measurements),
            sum(m.macs for m in measurements),
            sum(m.num_bytes for m in measurements),
            *limits,
        )
    )
    return measurements


def time_cold_layers(
    weights: dict[str, PackedWeight],
    rows: int,
    threads: int,
    repeats: int,
    isa: str,
    gen: torch.Generator,
    limits: tuple[float, float],
) -> Measurement:
    """NUM_LAYERS distinct copies of the layer swept once per call: weights from memory."""
    layers = [{name: w.clone() for name, w in weights.items()} for _ in range(NUM_LAYERS)]
    inputs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in PROJECTIONS.values()}}

    def sweep() -> None:
        for layer in layers:
            for name, (_, in_features) in PROJECTIONS.items():
                w = layer[name]
                x = inputs[in_features]
                cpu_kernels.q4_linear(x, w.qweight, w.scales, w.mins, GROUP_SIZE, isa)

    seconds = best_of(repeats, sweep) / NUM_LAYERS
    macs = sum(rows * n * k for n, k in PROJECTIONS.values())
    num_bytes = sum(call_bytes(weights[name], rows, *shape) for name, shape in PROJECTIONS.items())
    return Measurement("layer, cold", rows, threads, seconds, macs, num_bytes, *limits)


def read_bandwidth(repeats: int) -> float:
    """Bytes/s of torch's sum over an fp32 tensor far larger than the last-level cache."""
    stream = torch.ones(STREAM_BYTES // 4)
    return STREAM_BYTES / best_of(repeats, stream.sum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--iters", type=int, default=200_000, help="peak loop rounds per run")
    parser.add_argument("--isa", default="auto", choices=["auto", "avx2", "vnni"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/q4_gemm.json"))
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("modelship's CPU kernels are unavailable on this machine")

    loadavg_before = Path("/proc/loadavg").read_text().split()[:3]
    isa = cpu_kernels.q4_kernel_isa() if args.isa == "auto" else args.isa
    peaks = measure_peaks(peak_kinds(cpu_flags()), args.threads, args.iters)
    gen = torch.Generator().manual_seed(0)
    weights = {name: random_weight(*shape, gen) for name, shape in PROJECTIONS.items()}
    measurements: list[Measurement] = []
    bandwidths = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidths[threads] = read_bandwidth(args.repeats)
        limits = (peak_of_isa(peaks, isa, threads), bandwidths[threads])
        print(
            f"{threads} thread(s): {isa} peak {limits[0] / 1e9:.1f} GMAC/s, "
            f"read bandwidth {limits[1] / 1e9:.1f} GB/s"
        )
        print(
            f"{'projection':<12}{'rows':>5}{'thr':>4}{'ms':>9}{'GMAC/s':>9}{'peak':>8}"
            f"{'GB/s':>8}{'bw':>7}"
        )
        for rows in args.rows:
            for m in time_layer(weights, rows, threads, args.repeats, isa, gen, limits):
                measurements.append(m)
                print(m.line())
            if rows == 1:
                cold = time_cold_layers(weights, rows, threads, args.repeats, isa, gen, limits)
                measurements.append(cold)
                print(cold.line())
    loadavg_after = Path("/proc/loadavg").read_text().split()[:3]
    print(f"load average before {' '.join(loadavg_before)}, after {' '.join(loadavg_after)}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "cpu": cpu_model(),
        "loadavg_before": loadavg_before,
        "loadavg_after": loadavg_after,
        "q4_kernel_isa": isa,
        "peaks_macs_per_s": {k: {str(n): v for n, v in d.items()} for k, d in peaks.items()},
        "read_bandwidth_bytes_per_s": {str(n): v for n, v in bandwidths.items()},
        "kernel": [m.as_json() for m in measurements],
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
