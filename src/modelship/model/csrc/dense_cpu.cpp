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
// prefetched. Four rows and more are compute-bound. Without AVX-512 (or below 8 rows):
// 4 activation rows x 2 weight rows per tile (8 ymm accumulators). With AVX-512, from 8
// rows on, a thread widens 8 weight rows at a time into an fp32 buffer once (two rows
// interleaved per 16-lane vector, 8 columns each) while the next 8 are prefetched, then
// runs every activation row against them in 6-row x 8-column register tiles (24 zmm
// accumulators), over blocks of K that keep the widened block in L1 and blocks of rows
// that keep their activations in L2. A zmm lane half is exactly the 8-lane accumulator
// the AVX2 tiles keep, so both ISAs and every tile give the same bits.

#include "dense_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

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

// ---- AVX-512: widened 8-row weight groups, 6 x 8 register tiles ----------------------
//
// Only called where the CPU has AVX-512F (`has_avx512`). The target attribute is per
// function: the headers' inline functions stay compiled for the library's own flags.
#define MODELSHIP_AVX512 __attribute__((target("avx512f")))

constexpr int kPairs = 4;              // weight-row pairs in one group: 8 weight rows
constexpr int64_t kGroupRows = 2 * kPairs;
constexpr int kTileRows = 6;           // activation rows per tile: 6 x 4 zmm accumulators
constexpr int64_t kBlockSteps = 64;    // K blocks of up to 512 columns: 16 KiB widened
constexpr int64_t kBlockRows = 128;    // row blocks: their activations stay in L2
// Fewer rows: the AVX2 tiles above. Widening into the buffer costs about as many vector
// operations per weight as 8 rows' FMAs, so below that it does not pay for itself.
constexpr int64_t kPackedMinRows = 8;

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

// The next group's weight bytes, fetched into L2 a few lines per tile step while this group
// computes, so that its widening finds them there: with 8 to 16 rows, a group's compute and
// its weights' trip from memory take about as long, and overlap instead of adding up.
struct Prefetcher {
  const char* next;
  const char* end;
  int64_t per_step;  // lines per tile step
  inline void step() {
    for (int64_t i = 0; i < per_step && next < end; ++i, next += 64) {
      _mm_prefetch(next, _MM_HINT_T1);
    }
  }
};

// Weight rows n .. n + rows - 1 (rows <= 2 * pairs) widened into `ws`: for each 8-column
// step s and pair p, 16 floats = row n + 2p's columns 8s .. 8s + 7, then row n + 2p + 1's
// (zeros for a missing odd row). Columns past K / 8 * 8 are left to the scalar tail.
template <typename W>
MODELSHIP_AVX512 void widen_group(const W* w, int64_t n, int64_t rows, int pairs, int64_t K,
                                  float* ws) {
  const int64_t steps = K / 8;
  for (int64_t row = 0; row < 2 * pairs; ++row) {
    float* dst = ws + (row / 2) * 16 + (row % 2) * 8;
    if (row >= rows) {
      const __m256 zero = _mm256_setzero_ps();
      for (int64_t s = 0; s < steps; ++s) _mm256_store_ps(dst + s * pairs * 16, zero);
      continue;
    }
    const W* src = w + (n + row) * K;
    for (int64_t s = 0; s < steps; ++s) _mm256_store_ps(dst + s * pairs * 16, widen8(src + 8 * s));
  }
}

// Rows x[0 .. R - 1] (stride K) against the group's P pairs over steps [s0, s1); the
// accumulators start from zero at step 0, else from `partial`, and end in `partial`
// ([R][P] x 16 floats). The same FMA chain per lane half as `dense_tile`'s 8-lane one.
template <int R, int P>
MODELSHIP_AVX512 inline void pair_tile(const float* x, int64_t K, const float* ws, int64_t s0,
                                       int64_t s1, float* partial, Prefetcher& ahead) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) {
      acc[r][p] = s0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(partial + (r * P + p) * 16);
    }
  }
  for (int64_t s = s0; s < s1; ++s) {
    ahead.step();
    const float* wk = ws + s * P * 16;
    __m512 wv[P];
    for (int p = 0; p < P; ++p) wv[p] = _mm512_load_ps(wk + p * 16);
    for (int r = 0; r < R; ++r) {
      // columns 8s .. 8s + 7 of row r in both lane halves
      const auto* xr = reinterpret_cast<const double*>(x + r * K + 8 * s);
      const __m512 xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(xr)));
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) _mm512_store_ps(partial + (r * P + p) * 16, acc[r][p]);
  }
}

template <int P>
MODELSHIP_AVX512 void group_steps(const float* x, int64_t M, int64_t K, const float* ws,
                                  int64_t s0, int64_t s1, float* partial, Prefetcher& ahead) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows) {
    pair_tile<kTileRows, P>(x + m * K, K, ws, s0, s1, partial + m * P * 16, ahead);
  }
  float* tail = partial + m * P * 16;
  switch (M - m) {
    case 5: pair_tile<5, P>(x + m * K, K, ws, s0, s1, tail, ahead); break;
    case 4: pair_tile<4, P>(x + m * K, K, ws, s0, s1, tail, ahead); break;
    case 3: pair_tile<3, P>(x + m * K, K, ws, s0, s1, tail, ahead); break;
    case 2: pair_tile<2, P>(x + m * K, K, ws, s0, s1, tail, ahead); break;
    case 1: pair_tile<1, P>(x + m * K, K, ws, s0, s1, tail, ahead); break;
    default: break;
  }
}

// Rows x[0 .. M - 1] against weight rows n .. n + rows - 1, widened in `ws` (pairs of them):
// K blocks outside, row tiles inside, so a widened block serves every row from L1; then
// each output's two-level sum, as `dense_tile`'s.
template <typename W>
MODELSHIP_AVX512 void group_rows(const float* x, const W* w, int64_t M, int64_t n, int64_t rows,
                                 int pairs, int64_t N, int64_t K, const float* ws, float* partial,
                                 Prefetcher ahead, float* out) {
  const int64_t steps = K / 8, k8 = steps * 8;
  const int64_t blocks = std::max<int64_t>(1, (steps + kBlockSteps - 1) / kBlockSteps);
  const int64_t block = (steps + blocks - 1) / blocks;
  const int64_t tile_steps = steps * ((M + kTileRows - 1) / kTileRows);
  const int64_t lines = (ahead.end - ahead.next + 63) / 64;
  ahead.per_step = tile_steps > 0 ? (lines + tile_steps - 1) / tile_steps : 0;
  for (int64_t s0 = 0; s0 < steps; s0 += block) {
    const int64_t s1 = std::min(steps, s0 + block);
    switch (pairs) {
      case 4: group_steps<4>(x, M, K, ws, s0, s1, partial, ahead); break;
      case 3: group_steps<3>(x, M, K, ws, s0, s1, partial, ahead); break;
      case 2: group_steps<2>(x, M, K, ws, s0, s1, partial, ahead); break;
      default: group_steps<1>(x, M, K, ws, s0, s1, partial, ahead); break;
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t row = 0; row < rows; ++row) {
      float sum = 0.0f;
      const float* acc = partial + (m * pairs + row / 2) * 16 + (row % 2) * 8;
      if (steps > 0) sum = hsum(_mm256_load_ps(acc));
      const float* xr = x + m * K;
      const W* wr = w + (n + row) * K;
      for (int64_t k = k8; k < K; ++k) sum += xr[k] * widen1(wr[k]);
      out[m * N + n + row] = sum;
    }
  }
}

// Weight groups [g_begin, g_end) (8 rows each, the last one possibly fewer) for all M rows.
template <typename W>
MODELSHIP_AVX512 void packed_rows(const float* x, const W* w, int64_t M, int64_t N, int64_t K,
                                  int64_t g_begin, int64_t g_end, float* ws, float* partial,
                                  float* out) {
  for (int64_t m0 = 0; m0 < M; m0 += kBlockRows) {
    const int64_t rows_m = std::min(kBlockRows, M - m0);
    for (int64_t g = g_begin; g < g_end; ++g) {
      const int64_t n = g * kGroupRows, rows = std::min(kGroupRows, N - n);
      const int pairs = static_cast<int>((rows + 1) / 2);
      widen_group(w, n, rows, pairs, K, ws);
      // the thread's next group (none after its last)
      const W* next = w + std::min(n + kGroupRows, std::min(N, g_end * kGroupRows)) * K;
      const W* next_end = w + std::min(n + 2 * kGroupRows, std::min(N, g_end * kGroupRows)) * K;
      const Prefetcher ahead{reinterpret_cast<const char*>(next),
                             reinterpret_cast<const char*>(next_end), 0};
      group_rows(x + m0 * K, w, rows_m, n, rows, pairs, N, K, ws, partial, ahead,
                 out + m0 * N);
    }
  }
}

// 64-byte aligned floats (zmm loads and stores).
struct AlignedFloats {
  std::vector<float> storage;
  float* data;
  explicit AlignedFloats(int64_t size) : storage(size + 16) {
    const auto address = reinterpret_cast<uintptr_t>(storage.data());
    data = storage.data() + ((64 - address % 64) % 64) / sizeof(float);
  }
};

template <typename W>
void dense_rows(const float* x, const W* w, int64_t M, int64_t N, int64_t K, bool avx512,
                float* out) {
  if (avx512 && M >= kPackedMinRows) {
    const int64_t groups = (N + kGroupRows - 1) / kGroupRows;
    at::parallel_for(0, groups, 1, [&](int64_t g_begin, int64_t g_end) {
      AlignedFloats ws(kGroupRows * (K / 8 * 8));
      AlignedFloats partial(std::min(M, kBlockRows) * kGroupRows * 8);
      packed_rows(x, w, M, N, K, g_begin, g_end, ws.data, partial.data, out);
    });
    return;
  }
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

void dense_matmul_isa(const float* x, const modelship::DenseWeight& w, int64_t M, bool avx512,
                      float* out) {
  if (M == 0) return;
  switch (w.type) {
    case DenseType::kBFloat16:
      dense_rows(x, static_cast<const c10::BFloat16*>(w.data), M, w.N, w.K, avx512, out);
      break;
    case DenseType::kHalf:
      dense_rows(x, static_cast<const c10::Half*>(w.data), M, w.N, w.K, avx512, out);
      break;
    case DenseType::kFloat:
      dense_rows(x, static_cast<const float*>(w.data), M, w.N, w.K, avx512, out);
      break;
  }
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
  dense_matmul_isa(x, w, M, has_avx512(), out);
}

// x [M, K] (any float dtype) W^T (+ bias) -> [M, N] fp32; W bf16, fp16 or fp32 [N, K].
// isa "avx2" keeps to the AVX2 tiles (the same bits: tests compare), "auto" picks.
torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& weight,
                           const c10::optional<torch::Tensor>& bias, c10::string_view isa) {
  TORCH_CHECK(isa == "auto" || isa == "avx2", "isa must be \"auto\" or \"avx2\"");
  TORCH_CHECK(x.dim() == 2 && x.is_floating_point(), "x must be a float [M, K] tensor");
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const modelship::DenseWeight w = modelship::dense_weight(weight, N, K, "weight");
  const auto xf = x.to(at::kFloat).contiguous();
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  dense_matmul_isa(xf.data_ptr<float>(), w, M, isa == "auto" && has_avx512(),
                   out.data_ptr<float>());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [N]");
    out.add_(bias->to(at::kFloat));  // elementwise: each row on its own
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(modelship, m) {
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias, str isa=\"auto\") -> Tensor");
}

TORCH_LIBRARY_IMPL(modelship, CPU, m) { m.impl("dense_linear", &dense_linear); }
