// The W4A8 matmul on `q4_gemm.h`'s layout compiled for AVX512-VNNI, on 512-bit vectors:
// vpdpbusd sums four u8 x s8 products into each int32 lane in one instruction (vpmaddubsw +
// vpmaddwd on AVX2), and a zmm register carries two lanes of a block where the AVX2 path
// carries one, so each dot product, conversion and fma does twice the work.
// Called only where the CPU has AVX512-VNNI, VL and BW (`q4_cpu.cpp` checks at run time).
//
// Two lanes per vector: for lane pair p (lanes 2p and 2p + 1 of a chunk), dword 2j holds lane
// 2p of output row j and dword 2j + 1 lane 2p + 1 of it (a permutation of the 64 packed bytes
// of the two lanes). One 8-byte broadcast of the activations then puts lane 2p's 4 bytes under
// every even dword and lane 2p + 1's under every odd one. Each (row, group, lane) integer is
// the AVX2 path's, converted and fma'd with the same fp32 operands in the same group order;
// at the end the lanes are summed in the same tree, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
// (l3 + l7)), and the mins' term (accumulated over groups in the same order) added: the
// same roundings, so both paths give the same bits whatever the row count or tiling.
//
// Many rows: a block is unpacked (and its lanes paired) once into an L1-sized scratch per
// pass of rows, and row tiles of 4 read it; a pass holds as many rows as keep their int8
// activations in L1 beside the scratch, so every block of the pass re-reads them from L1
// rather than from L2.
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

constexpr int kLanePairs = 4;          // lane pairs per chunk of 64 columns
constexpr int kTileRows = 4;           // activation rows per register tile (16 accumulators)
constexpr int64_t kPassBytes = 24576;  // int8 activations of one pass of rows (L1: 48 KB)

// The 64 packed bytes of lanes 2p, 2p + 1 -> dword 2j: lane 2p of row j, 2j + 1: lane 2p + 1.
inline __m512i pair_lanes(const uint8_t* lanes) {
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  return _mm512_permutexvar_epi32(order, _mm512_loadu_si512(lanes));
}

// Packed bytes -> (low nibbles, high nibbles): a lane's columns 4i .., and 32 + 4i ...
inline void split_nibbles(__m512i bytes, __m512i& lo, __m512i& hi) {
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(bytes, low_mask);
  hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_mask);
}

// Lanes 2p and 2p + 1's activation bytes (8 consecutive bytes) in every 64-bit element.
inline __m512i broadcast8(const int8_t* q) {
  int64_t v;
  std::memcpy(&v, q, sizeof(v));
  return _mm512_set1_epi64(v);
}

// fp16 values of a block's 8 rows -> fp32, each twice: [v0, v0, v1, v1, .., v7, v7].
inline __m512 widen_twice(const uint16_t* h) {
  const __m512i order = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  return _mm512_permutexvar_ps(order, _mm512_castps256_ps512(v));
}

// Rows m0 .. m0 + R - 1 of `a` against one block: 8 outputs per row, written to out[r * N]
// (the first `valid` of them). `unpacked` (when Unpacked): the block's lane pairs already
// split, [K / 64][4 pairs][lo, hi]. Chunks: as in `q4x8_tile` (1 for G = 64, 0: from w.G).
template <int R, bool Unpacked, int Chunks>
inline void q4x8_tile512(const ActivationRows& a, const Q4Block& w, const __m512i* unpacked,
                         int64_t m0, int64_t N, int64_t valid, float* out) {
  const int64_t K = w.K, num_groups = K / w.G;
  const int64_t chunks_per_group = Chunks > 0 ? Chunks : w.G / kChunkCols;
  __m512 acc[R][kLanePairs];  // [row][lane pair]: 8 outputs x 2 lanes each
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < kLanePairs; ++p) acc[r][p] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < num_groups; ++g) {
    const __m512 s = widen_twice(w.scales + g * kBlockRows);
    __m512 sd[R];
    for (int r = 0; r < R; ++r) {
      sd[r] = _mm512_mul_ps(s, _mm512_set1_ps(a.d[(m0 + r) * num_groups + g]));
    }
#pragma GCC unroll 4
    for (int p = 0; p < kLanePairs; ++p) {
      __m512i sum[R];
      for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
      for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
        __m512i lo, hi;
        if (Unpacked) {
          lo = unpacked[(c * kLanePairs + p) * 2];
          hi = unpacked[(c * kLanePairs + p) * 2 + 1];
        } else {
          split_nibbles(pair_lanes(w.qweight + c * kChunkBytes + p * 64), lo, hi);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* q = a.q + (m0 + r) * K + c * kChunkCols + 8 * p;
          sum[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum[r], lo, broadcast8(q)), hi,
                                       broadcast8(q + 32));
        }
      }
      for (int r = 0; r < R; ++r) {
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), sd[r], acc[r][p]);
      }
    }
  }
  // The mins' term after the dot products (its own chain over the groups, in their order):
  // kept out of the loop above so the 4 x 4 accumulators keep their registers.
  __m256 min_term[R];
  for (int r = 0; r < R; ++r) min_term[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    const __m256 mn = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mins + g * kBlockRows)));
    for (int r = 0; r < R; ++r) {
      const float qsum = a.qsum[(m0 + r) * num_groups + g];
      min_term[r] = _mm256_add_ps(min_term[r], _mm256_mul_ps(mn, _mm256_set1_ps(qsum)));
    }
  }
  const __m512i even_odd =
      _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int r = 0; r < R; ++r) {
    // pairs (l0, l1) + (l4, l5) = (t0, t1), (l2, l3) + (l6, l7) = (t2, t3); their sum holds
    // t0 + t2 in even dwords and t1 + t3 in odd ones, added after separating them
    const __m512 t01 = _mm512_add_ps(acc[r][0], acc[r][2]);
    const __m512 t23 = _mm512_add_ps(acc[r][1], acc[r][3]);
    const __m512 halves = _mm512_permutexvar_ps(even_odd, _mm512_add_ps(t01, t23));
    const __m256 even = _mm512_castps512_ps256(halves);
    const __m256 odd = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(halves), 1));
    const __m256 result = _mm256_add_ps(_mm256_add_ps(even, odd), min_term[r]);
    float* dst = out + (m0 + r) * N;
    if (valid == kBlockRows) {
      _mm256_storeu_ps(dst, result);
    } else {
      alignas(32) float tmp[kBlockRows];
      _mm256_store_ps(tmp, result);
      std::memcpy(dst, tmp, valid * sizeof(float));
    }
  }
}

// Rows [m_begin, m_end) against one block, in tiles of kTileRows (and one smaller tile).
template <bool Unpacked, int Chunks>
void q4x8_rows512(const ActivationRows& a, const Q4Block& w, const __m512i* unpacked,
                  int64_t m_begin, int64_t m_end, int64_t N, int64_t valid, float* out) {
  int64_t m = m_begin;
  for (; m + kTileRows <= m_end; m += kTileRows) {
    q4x8_tile512<kTileRows, Unpacked, Chunks>(a, w, unpacked, m, N, valid, out);
  }
  switch (m_end - m) {
    case 3: q4x8_tile512<3, Unpacked, Chunks>(a, w, unpacked, m, N, valid, out); break;
    case 2: q4x8_tile512<2, Unpacked, Chunks>(a, w, unpacked, m, N, valid, out); break;
    case 1: q4x8_tile512<1, Unpacked, Chunks>(a, w, unpacked, m, N, valid, out); break;
    default: break;
  }
}

// Blocks [b_begin, b_end) of the weight for all M rows: out[m, 8b + c]. One or two rows read
// each weight once and unpack it in registers; more go in passes of rows (see the top).
template <int Chunks>
void q4x8_blocks512(const ActivationRows& a, const uint8_t* qweight, const uint16_t* scales,
                    const uint16_t* mins, int64_t M, int64_t N, int64_t K, int64_t G,
                    int64_t b_begin, int64_t b_end, __m512i* scratch, float* out) {
  const int64_t num_chunks = K / kChunkCols, num_groups = K / G;
  const bool unpack_once = M > 2;
  const int64_t fit = kPassBytes / K / kTileRows * kTileRows;
  const int64_t rows_per_pass = unpack_once ? (fit > kTileRows ? fit : kTileRows) : M;
  for (int64_t m_begin = 0; m_begin < M; m_begin += rows_per_pass) {
    const int64_t m_end = m_begin + rows_per_pass < M ? m_begin + rows_per_pass : M;
    for (int64_t b = b_begin; b < b_end; ++b) {
      const Q4Block w{qweight + b * num_chunks * kChunkBytes,
                      scales + b * num_groups * kBlockRows, mins + b * num_groups * kBlockRows,
                      K, G};
      const int64_t n0 = b * kBlockRows;
      const int64_t valid = N - n0 < kBlockRows ? N - n0 : kBlockRows;
      if (unpack_once) {
        for (int64_t c = 0; c < num_chunks; ++c) {
          for (int p = 0; p < kLanePairs; ++p) {
            split_nibbles(pair_lanes(w.qweight + c * kChunkBytes + p * 64),
                          scratch[(c * kLanePairs + p) * 2], scratch[(c * kLanePairs + p) * 2 + 1]);
          }
        }
        q4x8_rows512<true, Chunks>(a, w, scratch, m_begin, m_end, N, valid, out + n0);
      } else {
        q4x8_rows512<false, Chunks>(a, w, nullptr, m_begin, m_end, N, valid, out + n0);
      }
    }
  }
}

}  // namespace

namespace modelship {

void q4x8_blocks_vnni(const int8_t* q, const float* d, const float* qsum,
                      const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins,
                      int64_t M, int64_t N, int64_t K, int64_t G, int64_t b_begin,
                      int64_t b_end, __m256i* scratch, float* out) {
  const ActivationRows a{q, d, qsum};
  // the caller's scratch is 64-byte aligned and as many bytes as the AVX2 path's
  auto* unpacked = reinterpret_cast<__m512i*>(scratch);
  if (G == kChunkCols) {
    q4x8_blocks512<1>(a, qweight, scales, mins, M, N, K, G, b_begin, b_end, unpacked, out);
  } else {
    q4x8_blocks512<0>(a, qweight, scales, mins, M, N, K, G, b_begin, b_end, unpacked, out);
  }
}

}  // namespace modelship

#pragma GCC pop_options
