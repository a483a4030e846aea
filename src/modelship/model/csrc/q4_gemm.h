// The W4A8 matmul on the row-interleaved int4 layout: the layout, and the 256-bit kernel
// that q4_cpu.cpp compiles for AVX2. q4_vnni.cpp includes it too (after its `#pragma GCC
// target`) for the layout and runs its own 512-bit tile over it, with the same integers
// and the same float epilogue. Everything here has internal linkage and takes raw pointers,
// so the two copies never meet at link time (an inline function compiled for AVX-512 must
// not stand in for the AVX2 one on a CPU without it).
//
// Layout (written by `modelship.model.cpu_kernels.pack_q4`), output rows in blocks of 8
// (the last block padded with zero rows):
//   qweight uint8 [N/8, K/64 * 256]: per block and chunk of 64 input columns, 8 lanes i of
//           32 bytes; lane i holds, for each of the block's rows c, the 4 bytes 4i .. 4i+3
//           of that row's chunk, byte j holding column j in its low nibble and column j+32
//           in its high one (u in [0, 15]).
//   scales, mins fp16 [N/8, K/G, 8]: W[n, k] = u * scale + min per group of G columns.
// One 32-byte load thus holds 8 output rows' weights for the same 8 input columns, and one
// broadcast of 4 activation bytes feeds all 8 rows (vpmaddubsw + vpmaddwd, or vpdpbusd).
//
// Exactness: lane i of a block gathers, for each row, the columns 4i .. 4i+3 and 32+4i ..
// 32+4i+3 of every chunk: the same columns the row-major kernel summed in its lane i (its
// vpmaddubsw pairs and vpmaddwd). So the integer dot of each (row, group, lane) is the same
// integer, and the float epilogue (scale x activation scale, one fma per group and lane,
// then the lanes summed as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), then the mins' term added)
// is the same sequence of roundings, now done for 8 rows in each vector instruction. Rows
// never mix: a row's result does not depend on M or on the row tile.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlockRows = 8;                 // output rows interleaved in one block
constexpr int64_t kChunkCols = 64;                // input columns per 32 bytes of one row
constexpr int64_t kChunkBytes = kBlockRows * 32;  // one block's chunk: 8 lanes of 32 bytes

// The quantized activations a kernel reads (`QuantizedActivations` as raw pointers).
struct ActivationRows {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, K / G]
  const float* qsum;   // [M, K / G]
};

// One 8-row block of a `Q4Weight`, as raw pointers.
struct Q4Block {
  const uint8_t* qweight;   // [K / 64 * 256]
  const uint16_t* scales;   // fp16 [K / G, 8]
  const uint16_t* mins;     // fp16 [K / G, 8]
  int64_t K, G;
};

// Lane bytes -> (low nibbles, high nibbles): columns 4i .. of each row, and 32 + 4i ...
inline void unpack_lane(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_and_si256(bytes, low_mask);
  hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask);
}

inline __m256i broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, sizeof(v));
  return _mm256_set1_epi32(v);
}

// Rows m0 .. m0 + R - 1 of `a` against one block: 8 outputs per row, written to out[r * N]
// (the first `valid` of them). `unpacked` (when Unpacked): the block's lanes already
// split, [K / 64][8 lanes][lo, hi]. Chunks: the group's chunks of 64 columns when known at
// compile time (1 for G = 64), 0 to read it from w.G.
//
// The lane loop is unrolled so that acc[r][i] stays in registers: rolled, GCC kept the R x 8
// accumulators on the stack (a load and a store per lane and group). With the chunk loop
// also known (G = 64), a lane is straight-line code: its dot products, one conversion and one
// fma per row. Neither changes an operation or its order, only where values live.
template <typename Dot, int R, bool Unpacked, int Chunks>
inline void q4x8_tile(const ActivationRows& a, const Q4Block& w, const __m256i* unpacked,
                      int64_t m0, int64_t N, int64_t valid, float* out) {
  const int64_t K = w.K, num_groups = K / w.G;
  const int64_t chunks_per_group = Chunks > 0 ? Chunks : w.G / kChunkCols;
  __m256 acc[R][8];   // [row][lane]: 8 outputs each
  __m256 min_term[R];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < 8; ++i) acc[r][i] = _mm256_setzero_ps();
    min_term[r] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < num_groups; ++g) {
    const __m256 s = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales + g * kBlockRows)));
    const __m256 mn = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mins + g * kBlockRows)));
    __m256 sd[R];
    for (int r = 0; r < R; ++r) {
      const int64_t ag = (m0 + r) * num_groups + g;
      sd[r] = _mm256_mul_ps(s, _mm256_set1_ps(a.d[ag]));
      min_term[r] = _mm256_add_ps(min_term[r], _mm256_mul_ps(mn, _mm256_set1_ps(a.qsum[ag])));
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      typename Dot::Sum sum[R];
      for (int r = 0; r < R; ++r) sum[r] = Dot::zero();
      for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
        __m256i lo, hi;
        if (Unpacked) {
          lo = unpacked[(c * 8 + i) * 2];
          hi = unpacked[(c * 8 + i) * 2 + 1];
        } else {
          unpack_lane(w.qweight + c * kChunkBytes + i * 32, lo, hi);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* q = a.q + (m0 + r) * K + c * kChunkCols + 4 * i;
          sum[r] = Dot::add(sum[r], lo, broadcast4(q), hi, broadcast4(q + 32));
        }
      }
      for (int r = 0; r < R; ++r) {
        acc[r][i] = _mm256_fmadd_ps(Dot::to_ps(sum[r]), sd[r], acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 t0 = _mm256_add_ps(acc[r][0], acc[r][4]);
    const __m256 t1 = _mm256_add_ps(acc[r][1], acc[r][5]);
    const __m256 t2 = _mm256_add_ps(acc[r][2], acc[r][6]);
    const __m256 t3 = _mm256_add_ps(acc[r][3], acc[r][7]);
    const __m256 total = _mm256_add_ps(_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3));
    const __m256 result = _mm256_add_ps(total, min_term[r]);
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

// Blocks [b_begin, b_end) of the weight for all M rows: out[m, 8b + c]. With more than a
// couple of rows each block is unpacked once into `scratch` ([K / 64 * 16] vectors) and
// reused by every row tile; a row or two reads each weight once and unpacks it in place.
// Chunks: as in `q4x8_tile`.
template <typename Dot, int Chunks>
void q4x8_blocks_of(const ActivationRows& a, const uint8_t* qweight, const uint16_t* scales,
                 const uint16_t* mins, int64_t M, int64_t N, int64_t K, int64_t G,
                 int64_t b_begin, int64_t b_end, __m256i* scratch, float* out) {
  constexpr int R = Dot::kRows;
  const int64_t num_chunks = K / kChunkCols, num_groups = K / G;
  const bool unpack_once = M > 2;
  for (int64_t b = b_begin; b < b_end; ++b) {
    const Q4Block w{qweight + b * num_chunks * kChunkBytes, scales + b * num_groups * kBlockRows,
                    mins + b * num_groups * kBlockRows, K, G};
    const int64_t n0 = b * kBlockRows;
    const int64_t valid = N - n0 < kBlockRows ? N - n0 : kBlockRows;
    float* block_out = out + n0;
    if (unpack_once) {
      for (int64_t c = 0; c < num_chunks; ++c) {
        for (int i = 0; i < 8; ++i) {
          unpack_lane(w.qweight + c * kChunkBytes + i * 32, scratch[(c * 8 + i) * 2],
                      scratch[(c * 8 + i) * 2 + 1]);
        }
      }
      int64_t m = 0;
      for (; m + R <= M; m += R) {
        q4x8_tile<Dot, R, true, Chunks>(a, w, scratch, m, N, valid, block_out);
      }
      for (; m < M; ++m) q4x8_tile<Dot, 1, true, Chunks>(a, w, scratch, m, N, valid, block_out);
    } else {
      for (int64_t m = 0; m < M; ++m) {
        q4x8_tile<Dot, 1, false, Chunks>(a, w, nullptr, m, N, valid, block_out);
      }
    }
  }
}

// `q4x8_blocks_of`, its chunk loop known at compile time for G = 64 (the demo model's).
template <typename Dot>
void q4x8_blocks(const ActivationRows& a, const uint8_t* qweight, const uint16_t* scales,
                 const uint16_t* mins, int64_t M, int64_t N, int64_t K, int64_t G,
                 int64_t b_begin, int64_t b_end, __m256i* scratch, float* out) {
  if (G == kChunkCols) {
    q4x8_blocks_of<Dot, 1>(a, qweight, scales, mins, M, N, K, G, b_begin, b_end, scratch, out);
  } else {
    q4x8_blocks_of<Dot, 0>(a, qweight, scales, mins, M, N, K, G, b_begin, b_end, scratch, out);
  }
}

}  // namespace
