// What the CPU kernels share across files: vector helpers, the W4A8 matmul on quantized
// activations, and the RoPE / K/V-write / paged-attention steps on raw pointers. The torch
// ops (`q4_cpu.cpp`, `attention_cpu.cpp`) and the fused decoder (`decoder_cpu.cpp`) are thin
// callers of these. Needs AVX2 + FMA + F16C.

#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace modelship {

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// exp(x) for 8 floats: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial
// (relative error ~2e-7). Inputs below -87 give 0; inputs must stay at or below 88.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 is_tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 split in two
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(is_tiny, result);
}

// Activations quantized per row and weight group for the W4A8 / W8A8 kernels: row m of a
// K-wide input is q[m * K ..], d[m * K / G ..], qsum[m * K / G ..] (rows packed at the
// stride of the matmul that reads them).
struct QuantizedActivations {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> d;      // [M, K / G]: one scale per row and weight group
  std::vector<float> qsum;   // [M, K / G]: d * sum(q) over the group
};

// One row of x (K floats) -> int8 per group of G columns, x ~= q * d (symmetric, round to
// nearest).
void quantize_row(const float* x, int64_t K, int64_t G, int8_t* q, float* d, float* qsum);

// A 4-bit weight in `pack_q4`'s row-interleaved layout (see q4_gemm.h): W[n, k] = u * scale
// + min, output rows in blocks of 8 (the last one padded with zero rows).
struct Q4Weight {
  const uint8_t* qweight;    // [ceil(N / 8), 4 K]
  const c10::Half* scales;   // [ceil(N / 8), K / G, 8]
  const c10::Half* mins;     // [ceil(N / 8), K / G, 8]
  int64_t N, K, G;           // N: the outputs written (at most 8 ceil(N / 8))
};

// Checks the three tensors of a 4-bit weight for K input columns (TORCH_CHECK naming
// `name`); N is set to 8 x the blocks (callers with a known N lower it).
Q4Weight q4_weight(const torch::Tensor& qweight, const torch::Tensor& scales,
                   const torch::Tensor& mins, int64_t K, const char* name);

// out [M, N] fp32 = x W^T for M rows of `a` quantized at w.K / w.G. Parallel over blocks of
// output rows; each output is reduced in one fixed order whatever M is, and the AVX2 and
// VNNI paths give the same bits.
void q4_matmul(const QuantizedActivations& a, const Q4Weight& w, int64_t M, float* out);

// `q4_vnni.cpp`: blocks [b_begin, b_end) of a weight on AVX512-VNNI (only call where the CPU
// has it). scratch: K / 4 vectors, 64-byte aligned, when M > 2.
void q4x8_blocks_vnni(const int8_t* q, const float* d, const float* qsum,
                      const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins,
                      int64_t M, int64_t N, int64_t K, int64_t G, int64_t b_begin,
                      int64_t b_end, __m256i* scratch, float* out);

// 8 cache values -> 8 floats: fp32 as is, int8 sign-extended and converted (not yet scaled).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// One layer's paged KV cache: values [num_slots, 2, KVH, D] of T (float or int8_t) and, for
// int8, one fp32 scale per (slot, k or v, KV head) vector [num_slots, 2, KVH]: x ~= q * s,
// s = absmax(x) / 127, q = round(x / s) to nearest even (`kv_cache.quantize_kv`).
template <typename T>
struct PagedKV {
  T* values;
  float* scales;  // null for fp32
};

// Where a step's tokens sit in the paged KV cache [num_slots, 2, KVH, D].
struct PagedStep {
  int64_t num_tokens;
  const int64_t* slot_mapping;  // [T]: where each token's k and v are written
  const int32_t* block_table;   // [R, width]: physical blocks of each request
  int64_t num_requests, width;
  const int32_t* token_req;     // [T]: each token's request
  const int32_t* token_pos;     // [T]: each token's position (attends 0 .. pos)
  int64_t block_size;
};

// TORCH_CHECKs every index (block ids, requests, positions, slots if given) once, before
// any thread reads through them.
void check_paged_step(const PagedStep& step, int64_t num_slots);

// RoPE on the q and k heads of qkv [T, (H + 2 KVH) D] (fp32, HF's rotate-half layout, sin
// with the sign folded in, tables [max_positions, D]); rotated q -> q [T, H, D], rotated k
// and v -> kv at each token's slot (int8: quantized per head vector). T: float or int8_t.
template <typename T>
void rope_write_kv(const float* qkv, const PagedStep& step, const float* cos, const float* sin,
                   int64_t H, int64_t KVH, int64_t D, float* q, PagedKV<T> kv);

// out [T, H, D] = each query's attention over its request's positions 0 .. pos, read
// block by block in position order (online softmax). int8 keys and values are converted in
// the dot products and the value sums and multiplied by their vector's scale there.
template <typename T>
void paged_attention_rows(const float* q, PagedKV<T> kv, const PagedStep& step, int64_t H,
                          int64_t KVH, int64_t D, float scale, float* out);

}  // namespace modelship
