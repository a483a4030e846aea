// W4A8 linear for x86 CPUs with AVX2: 4-bit group-wise weights times activations quantized
// on the fly to int8, the integer products summed with vpmaddubsw/vpmaddwd (or vpdpbusd
// where the CPU has AVX512-VNNI: `q4_vnni.cpp`).
//
// Why: torch's `_weight_int4pack_mm_for_cpu` runs bf16 arithmetic, which AVX2 CPUs emulate;
// an integer dot product reads the same 4-bit weights and does 32 multiply-adds per
// instruction.
//
// Layouts: the weight is row-interleaved in blocks of 8 output rows (`q4_gemm.h`, written
// by `modelship.model.cpu_kernels.pack_q4` at load time); W[n, k] = u * scale + min per
// group of G columns (G a multiple of 64, at most 256).
//   x        [M, K] bf16 or fp32 -> per row, per group of G: int8 q and one scale d,
//            x ~= q * d (symmetric, round to nearest). The integer dot products of a
//            group add up in int16 lanes on AVX2, so G <= 256 keeps them from overflowing.
// Every output row is reduced in the same order whatever M is and however rows are tiled,
// so a request's result never depends on which other requests share its batch.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "q4_gemm.h"

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

constexpr int kRowTile = 4;  // W8A8: activation rows sharing one weight row

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

struct DotAvx2 {
  using Sum = __m256i;  // int16 lanes; |.| <= G / 64 * 2 * 2 * 15 * 127 < 2^15 for G <= 256
  static constexpr int kRows = 1;  // 16 vector registers: one row's 8 accumulators
  static inline Sum zero() { return _mm256_setzero_si256(); }
  static inline Sum add(Sum sum, __m256i lo, __m256i q_lo, __m256i hi, __m256i q_hi) {
    return _mm256_add_epi16(
        sum, _mm256_add_epi16(_mm256_maddubs_epi16(lo, q_lo), _mm256_maddubs_epi16(hi, q_hi)));
  }
  static inline __m256 to_ps(Sum sum) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, _mm256_set1_epi16(1)));
  }
};

bool cpu_has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bw");
  return has;
}

// "auto": VNNI where the CPU has it; "avx2" and "vnni" force one (tests compare them).
bool use_vnni(const std::string& isa) {
  TORCH_CHECK(isa == "auto" || isa == "avx2" || isa == "vnni",
              "isa must be auto, avx2 or vnni, not ", isa);
  TORCH_CHECK(isa != "vnni" || cpu_has_vnni(), "this CPU has no AVX512-VNNI");
  return isa == "vnni" || (isa == "auto" && cpu_has_vnni());
}

// out [M, N] fp32 for M rows of `a`; threads take blocks of 8 output rows.
void q4_rows(const QuantizedActivations& a, const modelship::Q4Weight& w, int64_t M, bool vnni,
             float* out) {
  const int64_t num_blocks = (w.N + kBlockRows - 1) / kBlockRows;
  const auto* scales = reinterpret_cast<const uint16_t*>(w.scales);
  const auto* mins = reinterpret_cast<const uint16_t*>(w.mins);
  at::parallel_for(0, num_blocks, 2, [&](int64_t b_begin, int64_t b_end) {
    // the unpacked block: K / 4 vectors, 64-byte aligned for the VNNI path's 512-bit loads
    std::vector<__m256i> buffer(M > 2 ? w.K / kChunkCols * 16 + 1 : 0);
    const auto address = reinterpret_cast<uintptr_t>(buffer.data());
    auto* scratch = reinterpret_cast<__m256i*>((address + 63) & ~static_cast<uintptr_t>(63));
    if (vnni) {
      modelship::q4x8_blocks_vnni(a.q.data(), a.d.data(), a.qsum.data(), w.qweight, scales,
                                  mins, M, w.N, w.K, w.G, b_begin, b_end, scratch, out);
    } else {
      q4x8_blocks<DotAvx2>(ActivationRows{a.q.data(), a.d.data(), a.qsum.data()}, w.qweight,
                           scales, mins, M, w.N, w.K, w.G, b_begin, b_end, scratch, out);
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
  q4_rows(a, w, M, use_vnni("auto"), out);
}

// x [M, K] (bf16 or fp32, contiguous), the weight in `q4_gemm.h`'s layout with
// qweight [ceil(N / 8), 4 K] -> [M, 8 ceil(N / 8)] in x's dtype (the padding rows' outputs are
// zero; the caller drops them).
torch::Tensor q4_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                        const torch::Tensor& scales, const torch::Tensor& mins,
                        int64_t group_size, const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bf16 or fp32");
  const int64_t M = x.size(0), K = x.size(1);
  const modelship::Q4Weight w = modelship::q4_weight(qweight, scales, mins, K, "q4_linear");
  TORCH_CHECK(w.G == group_size, "group_size ", group_size, " but scales give ", w.G);
  const bool vnni = use_vnni(isa);
  auto out = torch::empty({M, w.N}, x.options().dtype(at::kFloat));
  if (M == 0) return out.to(x.scalar_type());
  const QuantizedActivations a = quantize_activations(x, group_size);
  q4_rows(a, w, M, vnni, out.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());  // round to nearest even
}

modelship::Q4Weight modelship::q4_weight(const torch::Tensor& qweight,
                                         const torch::Tensor& scales, const torch::Tensor& mins,
                                         int64_t K, const char* name) {
  TORCH_CHECK(K > 0 && K % kChunkCols == 0, name, ": K must be a multiple of 64");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.dim() == 2 && qweight.size(1) == 4 * K,
              name, ": qweight must be contiguous uint8 [ceil(N / 8), 4 K] with K = ", K);
  const int64_t num_blocks = qweight.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf &&
                  scales.is_contiguous() && mins.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == num_blocks && scales.size(2) == kBlockRows &&
                  scales.sizes() == mins.sizes(),
              name, ": scales and mins must be contiguous fp16 [ceil(N / 8), K / G, 8]");
  const int64_t groups = scales.size(1);
  TORCH_CHECK(groups > 0 && K % groups == 0, name, ": K / G groups");
  const int64_t G = K / groups;
  TORCH_CHECK(G % kChunkCols == 0 && G <= 256, name,
              ": group size a multiple of 64, at most 256");
  return {qweight.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(), mins.data_ptr<c10::Half>(),
          num_blocks * kBlockRows, K, G};
}

// Which instruction set `q4_linear` with isa "auto" runs: "vnni" or "avx2".
std::string q4_isa() { return cpu_has_vnni() ? "vnni" : "avx2"; }

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
  m.def(
      "q4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int group_size, "
      "str isa=\"auto\") -> Tensor");
  m.def("q4_isa() -> str", &q4_isa);  // no tensor to dispatch on: one implementation
}

TORCH_LIBRARY_IMPL(modelship, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
