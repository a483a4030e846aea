// Dense linear for x86 CPUs with AVX2 + FMA + F16C: bf16, fp16 or fp32 weights widened to
// fp32 in registers, fp32 accumulation (the `dense_linear` op, and the fused decoder's dense
// projections through `dense_matmul`).
//
// Why: torch's bf16 `F.linear` on a CPU without native bf16 runs emulated bf16 arithmetic
// whose reduction order (and, past `quant.base.UPCAST_MIN_ROWS`, whose path) depends on the
// number of rows, so a request's greedy tokens changed with the batch it shared. Here every
// output is reduced in one order whatever the batch.
//
// Tiles: a few rows (decode of one to three streams) read each weight once and wait on
// memory: each activation load feeds 4 weight rows, and the weight rows ahead are
// prefetched. Four rows and more share each widened weight vector across a 4-row tile
// (2 weight rows x 4 activation rows = 8 accumulators), so 16 rows read the weights once.

#include "dense_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "cpu_kernels.h"

namespace {

using modelship::DenseType;
using modelship::hsum;

inline __m256 widen8(const c10::BFloat16* p) {  // bf16 is fp32's upper half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 widen8(const c10::Half* p) {  // F16C
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline float widen1(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen1(c10::Half v) { return _cvtsh_ss(v.x); }
inline float widen1(float v) { return v; }

constexpr int kRowTile = 4;  // activation rows sharing one widened weight vector
// Weight rows this far ahead are prefetched on the memory-bound few-rows path.
constexpr int64_t kPrefetchRows = 8;

// Outputs (m0 .. m0 + R - 1) x (n .. n + NT - 1); R and NT are template arguments so the
// accumulators live in registers. Every output: acc = fma(x[k..k+8], w[k..k+8], acc) for
// k = 0, 8, .., then hsum, then the K % 8 tail in column order (no FMA contraction:
// `-ffp-contract=off`), the same whatever the tile.
template <int R, int NT, bool Prefetch, typename W>
inline void dense_tile(const float* x, const W* w, int64_t m0, int64_t n, int64_t N, int64_t K,
                       float* out) {
  constexpr int64_t kLine = 64 / sizeof(W);  // weight elements per cache line
  __m256 acc[R][NT];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NT; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  const int64_t k8 = K / 8 * 8;
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NT];
    for (int c = 0; c < NT; ++c) {
      const W* row = w + (n + c) * K + k;
      if (Prefetch && k % kLine == 0 && n + c + kPrefetchRows < N) {
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * K), _MM_HINT_T0);
      }
      wv[c] = widen8(row);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + (m0 + r) * K + k);
      for (int c = 0; c < NT; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NT; ++c) {
      float sum = hsum(acc[r][c]);
      for (int64_t k = k8; k < K; ++k) sum += x[(m0 + r) * K + k] * widen1(w[(n + c) * K + k]);
      out[(m0 + r) * N + n + c] = sum;
    }
  }
}

// Rows m0 .. m0 + R - 1 (R < 4: memory-bound) against columns [n_begin, n_end).
template <int R, typename W>
inline void few_rows(const float* x, const W* w, int64_t m0, int64_t n_begin, int64_t n_end,
                     int64_t N, int64_t K, float* out) {
  int64_t n = n_begin;
  for (; n + 4 <= n_end; n += 4) dense_tile<R, 4, true>(x, w, m0, n, N, K, out);
  for (; n < n_end; ++n) dense_tile<R, 1, true>(x, w, m0, n, N, K, out);
}

// All M rows against columns n .. n + NT - 1: 4-row tiles, then the remaining rows, while
// the NT weight rows are in L1.
template <int NT, typename W>
inline void all_rows(const float* x, const W* w, int64_t M, int64_t n, int64_t N, int64_t K,
                     float* out) {
  int64_t m = 0;
  for (; m + kRowTile <= M; m += kRowTile) dense_tile<kRowTile, NT, false>(x, w, m, n, N, K, out);
  switch (M - m) {
    case 3: dense_tile<3, NT, false>(x, w, m, n, N, K, out); break;
    case 2: dense_tile<2, NT, false>(x, w, m, n, N, K, out); break;
    case 1: dense_tile<1, NT, false>(x, w, m, n, N, K, out); break;
    default: break;
  }
}

template <typename W>
void dense_rows(const float* x, const W* w, int64_t M, int64_t N, int64_t K, float* out) {
  at::parallel_for(0, N, 16, [&](int64_t n_begin, int64_t n_end) {
    switch (M) {
      case 1: few_rows<1>(x, w, 0, n_begin, n_end, N, K, out); return;
      case 2: few_rows<2>(x, w, 0, n_begin, n_end, N, K, out); return;
      case 3: few_rows<3>(x, w, 0, n_begin, n_end, N, K, out); return;
      default: break;
    }
    int64_t n = n_begin;
    for (; n + 2 <= n_end; n += 2) all_rows<2>(x, w, M, n, N, K, out);
    for (; n < n_end; ++n) all_rows<1>(x, w, M, n, N, K, out);
  });
}

}  // namespace

modelship::DenseWeight modelship::dense_weight(const at::Tensor& w, int64_t N, int64_t K,
                                               const char* name) {
  const auto dtype = w.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat, name,
              ": a dense weight is bf16, fp16 or fp32");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(0) == N && w.size(1) == K, name,
              ": dense weight must be contiguous [", N, ", ", K, "]");
  const DenseType type = dtype == at::kBFloat16 ? DenseType::kBFloat16
                         : dtype == at::kHalf   ? DenseType::kHalf
                                                : DenseType::kFloat;
  return {w.data_ptr(), type, N, K};
}

void modelship::dense_matmul(const float* x, const DenseWeight& w, int64_t M, float* out) {
  if (M == 0) return;
  switch (w.type) {
    case DenseType::kBFloat16:
      dense_rows(x, static_cast<const c10::BFloat16*>(w.data), M, w.N, w.K, out);
      break;
    case DenseType::kHalf:
      dense_rows(x, static_cast<const c10::Half*>(w.data), M, w.N, w.K, out);
      break;
    case DenseType::kFloat:
      dense_rows(x, static_cast<const float*>(w.data), M, w.N, w.K, out);
      break;
  }
}

// x [M, K] (any float dtype) W^T (+ bias) -> [M, N] fp32; W bf16, fp16 or fp32 [N, K].
torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& weight,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_floating_point(), "x must be a float [M, K] tensor");
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const modelship::DenseWeight w = modelship::dense_weight(weight, N, K, "weight");
  const auto xf = x.to(at::kFloat).contiguous();
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  modelship::dense_matmul(xf.data_ptr<float>(), w, M, out.data_ptr<float>());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [N]");
    out.add_(bias->to(at::kFloat));  // elementwise: each row on its own
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(modelship, m) {
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(modelship, CPU, m) { m.impl("dense_linear", &dense_linear); }
