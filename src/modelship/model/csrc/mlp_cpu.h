// The fused decoder's projections and MLPs (`decoder_cpu.cpp`): a projection on fp32 rows
// (W4A8 on int8 activations, or dense), the gated MLP, and the mixture-of-experts MLP
// (`moe_cpu.cpp`). Every row is computed on its own: its activation quantization and its
// matmul reductions do not depend on the other rows, so a row's result is the same alone
// or in any batch. Needs AVX2 + FMA + F16C.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"
#include "dense_cpu.h"

namespace modelship {

// One projection: W4A8 on int8 activations, or dense on the fp32 rows.
struct Projection {
  Q4Weight q4;
  DenseWeight dense;
  bool is_dense;
};

// [N, K] from (qweight, scales, mins) of `pack_q4`, or (dense weight, empty, empty); checked
// with TORCH_CHECKs naming `name`.
Projection projection(const torch::Tensor* t, int64_t N, int64_t K, const char* name);

// The buffers a step's projections fill in turn, sized once for T rows of the widest input.
struct ProjectionScratch {
  QuantizedActivations a;   // a W4A8 projection's input
  std::vector<float> rows;  // a dense projection's fp32 input

  ProjectionScratch(int64_t T, int64_t max_k) : rows(T * max_k) {
    a.q.resize(T * max_k);
    a.d.resize(T * (max_k / 64));  // group sizes are multiples of 64
    a.qsum.resize(T * (max_k / 64));
  }
};

// x = silu(gate) * up over I columns; silu(g) = g / (1 + exp(-g)), exp's input capped at
// 88 (where g / (1 + e^88) is already -0).
inline void silu_mul(const float* gate, const float* up, int64_t I, float* x) {
  const __m256 one = _mm256_set1_ps(1.0f), cap = _mm256_set1_ps(88.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t k = 0; k < I; k += 8) {
    const __m256 g = _mm256_loadu_ps(gate + k);
    const __m256 e = exp8(_mm256_min_ps(_mm256_xor_ps(g, sign), cap));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(x + k, _mm256_mul_ps(silu, _mm256_loadu_ps(up + k)));
  }
}

// Quantize T rows for `w` (its K and group size), each row first made by `make_row(t, buf)`
// into a K-wide fp32 buffer (or taken as is when it returns a pointer of its own).
template <typename MakeRow>
void quantize_rows(int64_t T, const Q4Weight& w, QuantizedActivations& a, MakeRow make_row) {
  const int64_t K = w.K, groups = K / w.G;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(K);
    for (int64_t t = begin; t < end; ++t) {
      const float* row = make_row(t, buf.data());
      quantize_row(row, K, w.G, a.q.data() + t * K, a.d.data() + t * groups,
                   a.qsum.data() + t * groups);
    }
  });
}

// out [T, N] = T rows, each made by `make_row(t, buf)` (as in `quantize_rows`), times the
// projection: quantized to int8 for W4A8, gathered as fp32 for dense.
template <typename MakeRow>
void project(int64_t T, const Projection& p, ProjectionScratch& s, MakeRow make_row,
             float* out) {
  if (!p.is_dense) {
    quantize_rows(T, p.q4, s.a, make_row);
    q4_matmul(s.a, p.q4, T, out);
    return;
  }
  const int64_t K = p.dense.K;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* buf = s.rows.data() + t * K;
      const float* row = make_row(t, buf);
      if (row != buf) std::copy(row, row + K, buf);
    }
  });
  dense_matmul(s.rows.data(), p.dense, T, out);
}

// down(silu(gate) * up), gate and up in one projection [2 I, hidden].
struct GatedMlp {
  Projection gate_up;
  Projection down;
  int64_t intermediate;
};

// From six tensors: gate_up's three, then down's (as `projection`); I read from down.
GatedMlp gated_mlp(const torch::Tensor* t, int64_t hidden, const char* name);

// out [T, hidden] = the MLP of T rows made by `make_row` (as in `quantize_rows`);
// gate_up: scratch of at least T * 2 I floats.
template <typename MakeRow>
void run_gated_mlp(int64_t T, const GatedMlp& mlp, ProjectionScratch& s, float* gate_up,
                   MakeRow make_row, float* out) {
  const int64_t I = mlp.intermediate;
  project(T, mlp.gate_up, s, make_row, gate_up);  // [T, 2 I]: gate | up
  project(T, mlp.down, s, [&](int64_t t, float* buf) {
    const float* row = gate_up + t * 2 * I;
    silu_mul(row, row + I, I, buf);
    return buf;
  }, out);
}

// A routed MLP: the router's fp32 [E, hidden] weight, E experts, and optionally a shared
// expert added with weight sigmoid(x . shared_gate) (Qwen2-MoE).
struct MoE {
  DenseWeight router;
  std::vector<GatedMlp> experts;
  bool has_shared;
  GatedMlp shared;
  DenseWeight shared_gate;  // fp32 [1, hidden]
};

// How a routed layer picks experts: the top_k of the softmax over all experts, renormalized
// over the k when `normalize` (`model/moe.py`).
struct Routing {
  int64_t top_k;
  bool normalize;
};

// out [T, hidden] = the routed MLP of x [T, hidden] fp32 (the post-attention norm's rows);
// gate_up: scratch of at least T * 2 I floats for the widest expert.
void moe_forward(const MoE& moe, const Routing& routing, const float* x, int64_t T,
                 int64_t hidden, ProjectionScratch& s, float* gate_up, float* out);

}  // namespace modelship
