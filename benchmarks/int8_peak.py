"""The machine's int8 dot-product peak: what `benchmarks/q4_gemm.py` divides by.

    .venv/bin/python benchmarks/int8_peak.py [--threads 1 2] [--out FILE]

A loop of independent multiply-add chains (12 accumulators, enough to hide the
instructions' latency), timed on 1 and 2 threads, for each instruction sequence the CPU has:
  avx2-i16   vpmaddubsw + vpaddw (int16 sums: what the kernel's AVX2 path does per chunk)
  avx2-i32   vpmaddubsw + vpmaddwd + vpaddd (int32 sums, the textbook AVX2 int8 dot)
  vnni-256   vpdpbusd on ymm (AVX512-VNNI + VL)
  vnni-512   vpdpbusd on zmm (the kernel's VNNI path)
Counted in int8 multiply-adds (MACs) per second: one u8 x s8 product and its add; best of
`--runs` short runs. The machine may be shared: give `cat /proc/loadavg` with any number.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

# Written once, compiled twice: before the AVX-512 target pragma (AVX2 kinds, which must run
# on CPUs without AVX-512) and after it (VNNI kinds).
_CHAINS = r"""
// kChains independent chains acc = Op::step(acc, a, b), `iters` rounds. Every loop over the
// chains is unrolled so the accumulators live in registers (rolled, GCC kept them in a stack
// array: a load and a store per instruction, which measured a sixth of the peak). The empty asm
// statements make the compiler treat a, b and four accumulators as changed each round, so
// it neither hoists a product of the constant operands out of the loop nor drops a chain.
template <typename Op>
int64_t run_chains(int64_t iters) {
  typename Op::Vec acc[kChains];
  typename Op::Vec a = Op::splat8(3), b = Op::splat8(-2);
#pragma GCC unroll 16
  for (int c = 0; c < kChains; ++c) acc[c] = Op::splat32(c);
  for (int64_t it = 0; it < iters; ++it) {
    __asm__ volatile("" : "+v"(a), "+v"(b));
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = Op::step(acc[c], a, b);
    __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]));
  }
  int64_t sink = 0;
#pragma GCC unroll 16
  for (int c = 0; c < kChains; ++c) sink += Op::first(acc[c]);
  return sink;
}
"""

_PEAK_SOURCE = (
    r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {
constexpr int kChains = 12;
}

namespace avx2 {
"""
    + _CHAINS
    + r"""
// The AVX2 products take the accumulator as their signed operand (b is unused): with (a, b)
// alone they would be one product per round shared by every chain (GCC merges them), and the
// loop would time the additions only.
struct I16 {  // vpmaddubsw + vpaddw: 32 MACs
  using Vec = __m256i;
  static Vec splat8(int8_t v) { return _mm256_set1_epi8(v); }
  static Vec splat32(int32_t v) { return _mm256_set1_epi16(static_cast<int16_t>(v)); }
  static Vec step(Vec acc, Vec a, Vec) {
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(a, acc));
  }
  static int64_t first(Vec v) { return _mm256_extract_epi16(v, 0); }
};

struct I32 {  // vpmaddubsw + vpmaddwd + vpaddd: 32 MACs
  using Vec = __m256i;
  static Vec splat8(int8_t v) { return _mm256_set1_epi8(v); }
  static Vec splat32(int32_t v) { return _mm256_set1_epi32(v); }
  static Vec step(Vec acc, Vec a, Vec) {
    const Vec pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(a, acc), _mm256_set1_epi16(1));
    return _mm256_add_epi32(acc, pairs);
  }
  static int64_t first(Vec v) { return _mm256_extract_epi32(v, 0); }
};

int64_t run_i16(int64_t iters) { return run_chains<I16>(iters); }
int64_t run_i32(int64_t iters) { return run_chains<I32>(iters); }
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
"""
    + _CHAINS
    + r"""
struct Dp256 {  // vpdpbusd ymm: 32 MACs
  using Vec = __m256i;
  static Vec splat8(int8_t v) { return _mm256_set1_epi8(v); }
  static Vec splat32(int32_t v) { return _mm256_set1_epi32(v); }
  static Vec step(Vec acc, Vec a, Vec b) { return _mm256_dpbusd_epi32(acc, a, b); }
  static int64_t first(Vec v) { return _mm256_extract_epi32(v, 0); }
};

struct Dp512 {  // vpdpbusd zmm: 64 MACs
  using Vec = __m512i;
  static Vec splat8(int8_t v) { return _mm512_set1_epi8(v); }
  static Vec splat32(int32_t v) { return _mm512_set1_epi32(v); }
  static Vec step(Vec acc, Vec a, Vec b) { return _mm512_dpbusd_epi32(acc, a, b); }
  static int64_t first(Vec v) { return _mm_cvtsi128_si32(_mm512_castsi512_si128(v)); }
};

int64_t run_256(int64_t iters) { return run_chains<Dp256>(iters); }
int64_t run_512(int64_t iters) { return run_chains<Dp512>(iters); }
}  // namespace vnni
#pragma GCC pop_options

// MACs per second of `kind` on `threads` threads, each running `iters` loop iterations;
// -1 for an unknown kind.
extern "C" double int8_peak(const char* kind, int64_t threads, int64_t iters) {
  int64_t (*fn)(int64_t) = nullptr;
  int64_t macs_per_op = 32;
  if (std::strcmp(kind, "avx2-i16") == 0) fn = avx2::run_i16;
  else if (std::strcmp(kind, "avx2-i32") == 0) fn = avx2::run_i32;
  else if (std::strcmp(kind, "vnni-256") == 0) fn = vnni::run_256;
  else if (std::strcmp(kind, "vnni-512") == 0) { fn = vnni::run_512; macs_per_op = 64; }
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
)


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


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


def measure_peaks(
    kinds: list[str], threads: list[int], iters: int, runs: int = 30
) -> dict[str, dict[int, float]]:
    """Best of `runs` runs per kind and thread count, MACs/s. Short runs (200,000 rounds are
    ~2 ms) and many of them: on a shared machine some run without being preempted."""
    lib = build_peak_library()
    return {
        kind: {n: max(lib.int8_peak(kind.encode(), n, iters) for _ in range(runs)) for n in threads}
        for kind in kinds
    }


def peak_of_isa(peaks: dict[str, dict[int, float]], isa: str, threads: int) -> float:
    """The best peak, on `threads` threads, of the family the kernel runs ("vnni" or "avx2")."""
    return max(by_threads[threads] for kind, by_threads in peaks.items() if kind.startswith(isa))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iters", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/int8_peak.json"))
    args = parser.parse_args()
    kinds = peak_kinds(cpu_flags())
    loadavg = Path("/proc/loadavg").read_text().split()[:3]
    peaks = measure_peaks(kinds, args.threads, args.iters, args.runs)
    print(f"load average {' '.join(loadavg)}")
    print(f"{'peak GMAC/s':<14}" + "".join(f"{f'{n} thr':>10}" for n in args.threads))
    for kind, by_threads in peaks.items():
        print(f"{kind:<14}" + "".join(f"{by_threads[n] / 1e9:>10.1f}" for n in args.threads))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "cpu": cpu_model(),
        "loadavg": loadavg,
        "cpu_count": os.cpu_count(),
        "peaks_macs_per_s": {k: {str(n): v for n, v in d.items()} for k, d in peaks.items()},
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
