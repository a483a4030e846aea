"""The machine's int8 dot-product peak, and the share of it the W4A8 kernel reaches.

    .venv/bin/python benchmarks/int8_peak.py [--threads 1 2] [--rows 128 16] [--out FILE]

Peak: a loop of independent multiply-add chains (12 accumulators, enough to hide the
instructions' latency), timed on 1 and 2 threads, for each instruction sequence the CPU has:
  avx2-i16   vpmaddubsw + vpaddw (int16 sums: what the kernel's AVX2 path does per chunk)
  avx2-i32   vpmaddubsw + vpmaddwd + vpaddd (int32 sums, the textbook AVX2 int8 dot)
  vnni-256   vpdpbusd on ymm (AVX512-VNNI + VL; the kernel's VNNI path)
  vnni-512   vpdpbusd on zmm
Counted in int8 multiply-adds (MACs) per second: one u8 x s8 product and its add.

Kernel: `q4_linear` (activation quantization included) on the demo model's shapes
(SmolLM2-135M: hidden 576, intermediate 1536, 9 + 2 x 3 heads of 64, vocab 49152, group size
64) at 128 rows (a prefill chunk) and 16 rows (16 decoding streams), min of `--repeats`
calls; MACs = rows x out x in. The share is against the best peak of the instruction set
the kernel ran (`q4_kernel_isa`) on the same thread count. The machine may be shared: give
`cat /proc/loadavg` with any number.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from modelship.model import cpu_kernels
from modelship.model.quant.int4 import W4A8Linear

# name: (rows out, columns in) of one projection; the head is listed for §3's int4 head
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}
LAYER = ("qkv", "o", "gate_up", "down")

_PEAK_SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int kChains = 12;

int64_t run_avx2_i16(int64_t iters) {
  __m256i acc[kChains];
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi16(c);
  for (int64_t it = 0; it < iters; ++it) {
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(a, b));
    __asm__ volatile("" : "+x"(acc[0]), "+x"(acc[1]), "+x"(acc[2]), "+x"(acc[3]));
  }
  int64_t sink = 0;
  for (int c = 0; c < kChains; ++c) sink += _mm256_extract_epi16(acc[c], 0);
  return sink;
}

int64_t run_avx2_i32(int64_t iters) {
  __m256i acc[kChains];
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi32(c);
  for (int64_t it = 0; it < iters; ++it) {
    for (int c = 0; c < kChains; ++c) {
      acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
    }
    __asm__ volatile("" : "+x"(acc[0]), "+x"(acc[1]), "+x"(acc[2]), "+x"(acc[3]));
  }
  int64_t sink = 0;
  for (int c = 0; c < kChains; ++c) sink += _mm256_extract_epi32(acc[c], 0);
  return sink;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
int64_t run_vnni_256(int64_t iters) {
  __m256i acc[kChains];
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi32(c);
  for (int64_t it = 0; it < iters; ++it) {
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_dpbusd_epi32(acc[c], a, b);
    __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]));
  }
  int64_t sink = 0;
  for (int c = 0; c < kChains; ++c) sink += _mm256_extract_epi32(acc[c], 0);
  return sink;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
int64_t run_vnni_512(int64_t iters) {
  __m512i acc[kChains];
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c);
  for (int64_t it = 0; it < iters; ++it) {
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
    __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]));
  }
  int64_t sink = 0;
  for (int c = 0; c < kChains; ++c) sink += _mm512_reduce_add_epi32(acc[c]);
  return sink;
}

}  // namespace

// MACs per second of `kind` on `threads` threads, each running `iters` loop iterations;
// -1 for an unknown kind.
extern "C" double int8_peak(const char* kind, int64_t threads, int64_t iters) {
  int64_t (*fn)(int64_t) = nullptr;
  int64_t macs_per_op = 32;
  if (std::strcmp(kind, "avx2-i16") == 0) fn = run_avx2_i16;
  else if (std::strcmp(kind, "avx2-i32") == 0) fn = run_avx2_i32;
  else if (std::strcmp(kind, "vnni-256") == 0) fn = run_vnni_256;
  else if (std::strcmp(kind, "vnni-512") == 0) { fn = run_vnni_512; macs_per_op = 64; }
  if (fn == nullptr) return -1.0;
  std::vector<int64_t> sinks(threads);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) pool.emplace_back([&, t] { sinks[t] = fn(iters); });
  for (auto& th : pool) th.join();
  const auto elapsed = std::chrono::steady_clock::now() - start;
  const double seconds = std::chrono::duration<double>(elapsed).count();
  return static_cast<double>(threads) * iters * kChains * macs_per_op / seconds;
}
"""


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def peak_kinds(flags: set[str]) -> list[str]:
    kinds = ["avx2-i16", "avx2-i32"] if "avx2" in flags else []
    if {"avx512_vnni", "avx512vl", "avx512bw"} <= flags:
        kinds += ["vnni-256", "vnni-512"]
    return kinds


def build_peak_library() -> ctypes.CDLL:
    """The peak loops as a plain shared library (no torch headers: it builds in seconds)."""
    folder = Path(tempfile.gettempdir()) / "modelship-int8-peak"
    folder.mkdir(exist_ok=True)
    digest = hashlib.sha256(_PEAK_SOURCE.encode()).hexdigest()[:12]
    library = folder / f"int8_peak_{digest}.so"
    if not library.exists():
        source = folder / f"int8_peak_{digest}.cpp"
        source.write_text(_PEAK_SOURCE)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        command = ["g++", "-O2", "-mavx2", "-mfma", "-shared", "-fPIC", "-pthread"]
        subprocess.run([*command, str(source), "-o", str(partial)], check=True)
        partial.replace(library)
    lib = ctypes.CDLL(str(library))
    lib.int8_peak.restype = ctypes.c_double
    lib.int8_peak.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64]
    return lib


def measure_peaks(kinds: list[str], threads: list[int], iters: int) -> dict[str, dict[int, float]]:
    """Best of 5 runs per kind and thread count, MACs/s."""
    lib = build_peak_library()
    return {
        kind: {n: max(lib.int8_peak(kind.encode(), n, iters) for _ in range(5)) for n in threads}
        for kind in kinds
    }


def random_linear(out_features: int, in_features: int, gen: torch.Generator) -> W4A8Linear:
    groups = in_features // 64
    u = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
    scale = torch.rand(out_features, groups, generator=gen) * 0.05 + 0.01
    zero_point = torch.randint(-8, 8, (out_features, groups), generator=gen, dtype=torch.int32)
    return W4A8Linear.from_unpacked(u, scale, zero_point, 64, None)


def time_kernel(
    linear: W4A8Linear, in_features: int, rows: int, repeats: int, gen: torch.Generator
) -> float:
    x = torch.randn(rows, in_features, generator=gen)
    linear(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        linear(x)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 16])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--iters", type=int, default=2_000_000)
    parser.add_argument("--head", action="store_true", help="also time the 49152 x 576 head")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/int8_peak.json"))
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("modelship's CPU kernels are unavailable on this machine")

    flags = cpu_flags()
    kinds = peak_kinds(flags)
    loadavg = Path("/proc/loadavg").read_text().split()[:3]
    peaks = measure_peaks(kinds, args.threads, args.iters)
    isa = cpu_kernels.q4_kernel_isa()
    family = "vnni" if isa == "vnni" else "avx2"
    print(f"load average {' '.join(loadavg)}; W4A8 kernel path: {isa}")
    print(f"{'peak GMAC/s':<14}" + "".join(f"{f'{n} thr':>10}" for n in args.threads))
    for kind, by_threads in peaks.items():
        print(f"{kind:<14}" + "".join(f"{by_threads[n] / 1e9:>10.1f}" for n in args.threads))

    gen = torch.Generator().manual_seed(0)
    names = [*LAYER, "head"] if args.head else list(LAYER)
    linears = {name: random_linear(*SHAPES[name], gen) for name in names}
    kernel: list[dict] = []
    print(f"\n{'shape':<9}{'rows':>5}{'thr':>4}{'ms':>9}{'GMAC/s':>9}{'share':>8}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        peak = max(v[threads] for k, v in peaks.items() if k.startswith(family))
        for rows in args.rows:
            total_macs = total_seconds = 0.0
            for name in names:
                seconds = time_kernel(linears[name], SHAPES[name][1], rows, args.repeats, gen)
                macs = rows * SHAPES[name][0] * SHAPES[name][1]
                if name in LAYER:
                    total_macs += macs
                    total_seconds += seconds
                kernel.append(
                    {
                        "shape": name,
                        "rows": rows,
                        "threads": threads,
                        "seconds": seconds,
                        "macs_per_s": macs / seconds,
                        "share_of_peak": macs / seconds / peak,
                    }
                )
                print(
                    f"{name:<9}{rows:>5}{threads:>4}{seconds * 1e3:>9.3f}"
                    f"{macs / seconds / 1e9:>9.1f}{macs / seconds / peak:>8.1%}"
                )
            rate = total_macs / total_seconds
            kernel.append(
                {
                    "shape": "layer",
                    "rows": rows,
                    "threads": threads,
                    "seconds": total_seconds,
                    "macs_per_s": rate,
                    "share_of_peak": rate / peak,
                }
            )
            print(
                f"{'layer':<9}{rows:>5}{threads:>4}{total_seconds * 1e3:>9.3f}"
                f"{rate / 1e9:>9.1f}{rate / peak:>8.1%}"
            )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "cpu": next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "",
        ),
        "loadavg": loadavg,
        "cpu_count": os.cpu_count(),
        "q4_kernel_isa": isa,
        "peaks_macs_per_s": {k: {str(n): v for n, v in d.items()} for k, d in peaks.items()},
        "kernel": kernel,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
