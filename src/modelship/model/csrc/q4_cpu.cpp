// W4A8 linear for x86 CPUs with AVX2: 4-bit group-wise weights times activations quantized
// on the fly to int8, the integer products summed with vpmaddubsw/vpmaddwd.
//
// Why: torch's `_weight_int4pack_mm_for_cpu` runs bf16 arithmetic, which AVX2 CPUs emulate;
// an integer dot product reads the same 4-bit weights and does 32 multiply-adds per
// instruction.
//
// Layouts (written by `modelship.model.cpu_kernels.pack_q4`):
//   qweight  uint8 [N, K/2]: per chunk of 64 input columns 32 bytes, byte i holding
//            column i in its low nibble and column i+32 in its high nibble (u in [0, 15])
//   scales   fp16 [N, K/G], mins fp16 [N, K/G]: W[n, k] = u * scale + min, per group of G
//            columns (G a multiple of 64, at most 256)
//   x        [M, K] bf16 or fp32 -> per row, per group of G: int8 q and one scale d,
//            x ~= q * d (symmetric, round to nearest). The integer dot products of a
//            group add up in int16 lanes, so G <= 256 keeps them from overflowing.
// Every output row is reduced in the same order whatever M is and however rows are tiled,
// so a request's result never depends on which other requests share its batch.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

namespace modelship {

void quantize_row(const float* x, int64_t K, int64_t G, int8_t* q, float* d, float* qsum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < K / G; ++g) {
    const float* xg = x + g * G;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t j = 0; j < G; j += 8) {
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xg + j)));
    }
    const float scale = hmax(amax) / 127.0f;
    const __m256 inv = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    __m256i total = _mm256_setzero_si256();
    for (int64_t j = 0; j < G; j += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xg + j), inv);
      const __m256i r =
          _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      total = _mm256_add_epi32(total, r);
      // int32 -> int8 (values are within [-127, 127]); packs keep lanes 0-3 | 4-7 order
      const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + g * G + j), _mm_packs_epi16(w16, w16));
    }
    d[g] = scale;
    qsum[g] = scale * hsum(_mm256_cvtepi32_ps(total));
  }
}

}  // namespace modelship

namespace {

using modelship::hsum;
using modelship::QuantizedActivations;
using modelship::quantize_row;

constexpr int64_t kChunk = 64;   // columns per 32 packed bytes
constexpr int kRowTile = 4;  // activation rows sharing one unpacked weight chunk
// A few rows (decode of one or two streams) read each weight once and wait on memory: the
// weight rows this far ahead are prefetched (batch-1 decode of the demo model's 30 layers:
// 9.2 -> 7.0 ms on one thread). Batches of 4+ rows are compute-bound and skip it.
constexpr int64_t kPrefetchRows = 16;

QuantizedActivations quantize_activations(const torch::Tensor& x, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedActivations a;
  a.q.resize(M * K);
  a.d.resize(M * (K / G));
  a.qsum.resize(M * (K / G));
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  const float* xf = is_bf16 ? nullptr : x.data_ptr<float>();
  const uint16_t* xb = is_bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr()) : nullptr;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t m = begin; m < end; ++m) {
      const float* src = xf ? xf + m * K : row.data();
      if (xb) {
        for (int64_t k = 0; k < K; ++k) {
          const uint32_t bits = static_cast<uint32_t>(xb[m * K + k]) << 16;
          std::memcpy(&row[k], &bits, sizeof(float));
        }
      }
      quantize_row(src, K, G, a.q.data() + m * K, a.d.data() + m * (K / G),
                   a.qsum.data() + m * (K / G));
    }
  });
  return a;
}

// Output columns n .. n + NT - 1 for activation rows m0 .. m0 + R - 1; R and NT are template
// arguments so that the accumulators live in registers. Batches of 4+ rows share each
// unpacked weight chunk across rows (R = 4, NT = 1); a few rows (decode of one or two
// streams) share each activation load across NT = 4 weight rows instead, and prefetch.
template <int R, int NT, bool Prefetch, typename OutT>
inline void q4_tile(const QuantizedActivations& a, const uint8_t* qweight, const c10::Half* scales,
                    const c10::Half* mins, int64_t m0, int64_t n, int64_t N, int64_t K,
                    int64_t G, OutT* out) {
  const int64_t num_groups = K / G;
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][NT];
  float min_term[R][NT];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NT; ++c) {
      acc[r][c] = _mm256_setzero_ps();
      min_term[r][c] = 0.0f;
    }
  }
  const int8_t* q_tile = a.q.data() + m0 * K;
  for (int64_t g = 0; g < num_groups; ++g) {
    __m256i isum[R][NT];  // int16 lanes; |.| <= G / 64 * 2 * 2 * 15 * 127 < 2^15 for G <= 256
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < NT; ++c) isum[r][c] = _mm256_setzero_si256();
    }
    for (int64_t col = g * G; col < (g + 1) * G; col += kChunk) {
      __m256i lo[NT], hi[NT];
      for (int c = 0; c < NT; ++c) {
        const uint8_t* w = qweight + (n + c) * (K / 2) + col / 2;
        if (Prefetch && n + c + kPrefetchRows < N) {
          _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchRows * (K / 2)), _MM_HINT_T0);
        }
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
        lo[c] = _mm256_and_si256(bytes, low_mask);  // columns col .. col + 31
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask);  // col + 32 .. + 63
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* q = q_tile + r * K + col;
        const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
        for (int c = 0; c < NT; ++c) {
          isum[r][c] = _mm256_add_epi16(
              isum[r][c], _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], q0),
                                           _mm256_maddubs_epi16(hi[c], q1)));
        }
      }
    }
    for (int c = 0; c < NT; ++c) {
      const int64_t sg = (n + c) * num_groups + g;
      const float s = _cvtsh_ss(scales[sg].x);  // F16C, not c10::Half's bit-twiddling
      const float mn = _cvtsh_ss(mins[sg].x);
      for (int r = 0; r < R; ++r) {
        const int64_t ag = (m0 + r) * num_groups + g;
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum[r][c], ones));
        acc[r][c] = _mm256_fmadd_ps(dot, _mm256_set1_ps(s * a.d[ag]), acc[r][c]);
        min_term[r][c] += mn * a.qsum[ag];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NT; ++c) {
      out[(m0 + r) * N + n + c] = static_cast<OutT>(hsum(acc[r][c]) + min_term[r][c]);
    }
  }
}

// Rows m0 .. m0 + R - 1 against output columns [n_begin, n_end).
template <int R, typename OutT>
inline void q4_few_rows(const QuantizedActivations& a, const uint8_t* qweight,
                        const c10::Half* scales, const c10::Half* mins, int64_t m0,
                        int64_t n_begin, int64_t n_end, int64_t N, int64_t K, int64_t G,
                        OutT* out) {
  int64_t n = n_begin;
  for (; n + 4 <= n_end; n += 4) {
    q4_tile<R, 4, true>(a, qweight, scales, mins, m0, n, N, K, G, out);
  }
  for (; n < n_end; ++n) q4_tile<R, 1, true>(a, qweight, scales, mins, m0, n, N, K, G, out);
}

template <typename OutT>
void q4_rows(const QuantizedActivations& a, const uint8_t* qweight, const c10::Half* scales,
             const c10::Half* mins, int64_t M, int64_t N, int64_t K, int64_t G, OutT* out) {
  at::parallel_for(0, N, 16, [&](int64_t n_begin, int64_t n_end) {
    const int64_t m0 = M / kRowTile * kRowTile;  // rows past m0 go in a few-rows tile
    for (int64_t n = n_begin; n < n_end; ++n) {
      for (int64_t m = 0; m < m0; m += kRowTile) {
        q4_tile<kRowTile, 1, false>(a, qweight, scales, mins, m, n, N, K, G, out);
      }
    }
    switch (M - m0) {
      case 3: q4_few_rows<3>(a, qweight, scales, mins, m0, n_begin, n_end, N, K, G, out); break;
      case 2: q4_few_rows<2>(a, qweight, scales, mins, m0, n_begin, n_end, N, K, G, out); break;
      case 1: q4_few_rows<1>(a, qweight, scales, mins, m0, n_begin, n_end, N, K, G, out); break;
      default: break;
    }
  });
}

// int8 weights (symmetric, one scale per output row) x int8 activations: output column n
// for activation rows m0 .. m0 + R - 1. vpmaddubsw needs an unsigned operand, so it gets
// |w| and the activations take w's sign (vpsignb); a pair sum stays below 2 * 128 * 127.
template <int R, typename OutT>
inline void q8_tile(const QuantizedActivations& a, const int8_t* wrow, float wscale,
                    int64_t m0, int64_t n, int64_t N, int64_t K, int64_t G, OutT* out) {
  const int64_t num_groups = K / G;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* q_tile = a.q.data() + m0 * K;
  for (int64_t g = 0; g < num_groups; ++g) {
    __m256i isum[R];  // int32 lanes
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int64_t col = g * G; col < (g + 1) * G; col += 32) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + col));
      const __m256i w_abs = _mm256_sign_epi8(w, w);
      for (int r = 0; r < R; ++r) {
        const __m256i q =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q_tile + r * K + col));
        const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(q, w));
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs, ones));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_set1_ps(a.d[(m0 + r) * num_groups + g]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), d, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[(m0 + r) * N + n] = static_cast<OutT>(hsum(acc[r]) * wscale);
  }
}

template <typename OutT>
void q8_rows(const QuantizedActivations& a, const int8_t* qweight, const float* wscales,
             int64_t M, int64_t N, int64_t K, int64_t G, OutT* out) {
  at::parallel_for(0, N, 64, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t n = n_begin; n < n_end; ++n) {
      const int8_t* w = qweight + n * K;
      int64_t m0 = 0;
      for (; m0 + kRowTile <= M; m0 += kRowTile) {
        q8_tile<kRowTile>(a, w, wscales[n], m0, n, N, K, G, out);
      }
      switch (M - m0) {
        case 3: q8_tile<3>(a, w, wscales[n], m0, n, N, K, G, out); break;
        case 2: q8_tile<2>(a, w, wscales[n], m0, n, N, K, G, out); break;
        case 1: q8_tile<1>(a, w, wscales[n], m0, n, N, K, G, out); break;
        default: break;
      }
    }
  });
}

}  // namespace

void modelship::q4_matmul(const QuantizedActivations& a, const Q4Weight& w, int64_t M,
                          float* out) {
  q4_rows<float>(a, w.qweight, w.scales, w.mins, M, w.N, w.K, w.G, out);
}

// x [M, K] (bf16 or fp32, contiguous) -> [M, N] in x's dtype.
torch::Tensor q4_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                        const torch::Tensor& scales, const torch::Tensor& mins,
                        int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bf16 or fp32");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(), "qweight: uint8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf,
              "scales and mins: fp16");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(group_size % kChunk == 0 && group_size <= 256 && K % group_size == 0,
              "group_size must be a multiple of 64 (at most 256) dividing K");
  TORCH_CHECK(qweight.size(1) * 2 == K, "qweight must be [N, K/2]");
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == K / group_size, "scales: [N, K/G]");
  TORCH_CHECK(mins.sizes() == scales.sizes(), "mins: [N, K/G]");
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const QuantizedActivations a = quantize_activations(x, group_size);
  const auto* w = qweight.data_ptr<uint8_t>();
  const auto* s = scales.data_ptr<c10::Half>();
  const auto* mn = mins.data_ptr<c10::Half>();
  if (x.scalar_type() == at::kBFloat16) {
    q4_rows<c10::BFloat16>(a, w, s, mn, M, N, K, group_size, out.data_ptr<c10::BFloat16>());
  } else {
    q4_rows<float>(a, w, s, mn, M, N, K, group_size, out.data_ptr<float>());
  }
  return out;
}

// x [M, K] (bf16 or fp32, contiguous), qweight int8 [N, K], wscales fp32 [N]: W = q * scale.
// Activations are quantized per group of `group_size` columns -> [M, N] fp32.
torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                        const torch::Tensor& wscales, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bf16 or fp32");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(), "qweight: int8");
  TORCH_CHECK(wscales.scalar_type() == at::kFloat && wscales.is_contiguous(), "wscales: fp32");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K && wscales.size(0) == N, "qweight [N, K], wscales [N]");
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0,
              "group_size must be a multiple of 32 dividing K");
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return out;
  const QuantizedActivations a = quantize_activations(x, group_size);
  q8_rows<float>(a, qweight.data_ptr<int8_t>(), wscales.data_ptr<float>(), M, N, K, group_size,
                 out.data_ptr<float>());
  return out;
}

TORCH_LIBRARY(modelship, m) {
  m.def("q8_linear(Tensor x, Tensor qweight, Tensor wscales, int group_size) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(modelship, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
