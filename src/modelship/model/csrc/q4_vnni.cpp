// The W4A8 matmul (`q4_gemm.h`) compiled for AVX512-VNNI: vpdpbusd on 256-bit vectors sums
// four u8 x s8 products into each int32 lane in one instruction (vpmaddubsw + vpmaddwd
// on AVX2), and AVX512VL's 32 vector registers hold two rows' accumulators at once.
// Called only where the CPU has AVX512-VNNI and AVX512VL (`q4_cpu.cpp` checks at run time);
// the integer sums are the AVX2 path's, so both give bit-identical results.
//
// Nothing from torch or the standard library is included after the target pragma: their
// inline functions would be compiled for AVX-512 here and could be picked by the linker for
// the whole library.

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

#include "q4_gemm.h"

namespace {

struct DotVnni {
  using Sum = __m256i;  // int32 lanes
  static constexpr int kRows = 2;
  static inline Sum zero() { return _mm256_setzero_si256(); }
  static inline Sum add(Sum sum, __m256i lo, __m256i q_lo, __m256i hi, __m256i q_hi) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(sum, lo, q_lo), hi, q_hi);
  }
  static inline __m256 to_ps(Sum sum) { return _mm256_cvtepi32_ps(sum); }
};

}  // namespace

namespace modelship {

void q4x8_blocks_vnni(const int8_t* q, const float* d, const float* qsum,
                      const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins,
                      int64_t M, int64_t N, int64_t K, int64_t G, int64_t b_begin,
                      int64_t b_end, __m256i* scratch, float* out) {
  q4x8_blocks<DotVnni>(ActivationRows{q, d, qsum}, qweight, scales, mins, M, N, K, G, b_begin,
                       b_end, scratch, out);
}

}  // namespace modelship

#pragma GCC pop_options
