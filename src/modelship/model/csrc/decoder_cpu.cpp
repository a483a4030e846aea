// Every decoder layer of a Llama-family model, plus the final norm, in one call: the CPU
// serving path with W4A8 or dense (bf16/fp16/fp32, `dense_cpu.cpp`) projections and the
// paged-attention kernel.
//
// Why: the layers' kernels take ~6.5 ms of a batch-1 decode step on the demo model, while
// running them from Python as ~35 small torch ops per layer cost as much again. Here the
// glue between the kernels is a few loops over rows, with no tensors made per op.
//
// Per layer, on fp32 rows (the residual stream stays fp32 from the embedding to the final
// norm; only the result is rounded to the compute dtype):
//   x = rmsnorm(residual) -> int8 per group -> qkv (+ bias) -> RoPE, K/V write, attention
//   -> int8 -> o_proj; residual += o; x = rmsnorm(residual) -> int8 -> gate_up
//   -> silu(gate) * up -> int8 -> down; residual += down
// (a dense projection takes its fp32 rows as they are, without the int8 step)
// Every row is computed on its own: its norm, activation quantization and matmul
// reductions do not depend on the other rows or on how a prompt was chunked, so greedy
// decoding stays repeatable.
//
//   hidden   [T, hidden] bf16 or fp32: the embeddings of this step's tokens
//   weights  kTensorsPerLayer tensors per layer, in `LayerTensor` order (`fused_decoder.py`)
//   kv_caches  one [num_slots, 2, KVH, D] per layer, fp32 or int8
//   kv_scales  int8 caches: one fp32 [num_slots, 2, KVH] per layer; fp32 caches: none
//   -> [T, hidden] in hidden's dtype: the final norm of the last layer's residual stream

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_kernels.h"
#include "dense_cpu.h"

namespace {

using modelship::exp8;
using modelship::hsum;
using modelship::Q4Weight;
using modelship::QuantizedActivations;

// The tensors of one layer: norm weights and the q/k/v bias fp32 (bias: an empty tensor
// when the model has none), each projection as (qweight, scales, mins) of `pack_q4`, or
// dense as (weight [N, K] bf16/fp16/fp32, empty, empty).
enum LayerTensor : int64_t {
  kInputNorm,
  kQkvWeight, kQkvScales, kQkvMins, kQkvBias,
  kOWeight, kOScales, kOMins,
  kPostNorm,
  kGateUpWeight, kGateUpScales, kGateUpMins,
  kDownWeight, kDownScales, kDownMins,
  kTensorsPerLayer,
};

// One projection: W4A8 on int8 activations, or dense on the fp32 rows.
struct Projection {
  Q4Weight q4;
  modelship::DenseWeight dense;
  bool is_dense;
};

struct Layer {
  const float* input_norm;  // [hidden]
  Projection qkv;           // [(H + 2 KVH) D, hidden]
  const float* qkv_bias;    // [(H + 2 KVH) D] or null
  Projection o;             // [hidden, H D]
  const float* post_norm;   // [hidden]
  Projection gate_up;       // [2 I, hidden]
  Projection down;          // [hidden, I]
  float* kv;                // this layer's fp32 cache [num_slots, 2, KVH, D], or null
  int8_t* kv_int8;          // this layer's int8 cache [num_slots, 2, KVH, D], or null
  float* kv_scales;         // with kv_int8: [num_slots, 2, KVH]
};

// RoPE, this step's K/V write and attention for one layer, on its cache's element type.
void attend(const Layer& layer, const float* qkv, const modelship::PagedStep& step,
            const float* cos, const float* sin, int64_t H, int64_t KVH, int64_t D, float scale,
            float* q, float* out) {
  auto run = [&](auto cache) {
    modelship::rope_write_kv(qkv, step, cos, sin, H, KVH, D, q, cache);
    modelship::paged_attention_rows(q, cache, step, H, KVH, D, scale, out);
  };
  if (layer.kv_int8 != nullptr) {
    run(modelship::PagedKV<int8_t>{layer.kv_int8, layer.kv_scales});
  } else {
    run(modelship::PagedKV<float>{layer.kv, nullptr});
  }
}

const float* fp32_vector(const torch::Tensor& t, int64_t size, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 &&
                  t.size(0) == size,
              name, ": contiguous fp32 [", size, "]");
  return t.data_ptr<float>();
}

Q4Weight q4_weight(const torch::Tensor* t, int64_t N, int64_t K, const char* name) {
  Q4Weight w = modelship::q4_weight(t[0], t[1], t[2], K, name);
  TORCH_CHECK(w.N == (N + 7) / 8 * 8, name, ": ", (N + 7) / 8, " blocks of 8 rows for N = ", N);
  w.N = N;
  return w;
}

Projection projection(const torch::Tensor* t, int64_t N, int64_t K, const char* name) {
  if (t[0].scalar_type() == at::kByte) return {q4_weight(t, N, K, name), {}, false};
  return {{}, modelship::dense_weight(t[0], N, K, name), true};
}

// residual += branch (when given); x = rmsnorm(residual) * weight, all fp32. The sum of
// squares is reduced in one fixed order per row.
inline void add_rmsnorm(float* residual, const float* branch, const float* weight, int64_t K,
                        float eps, float* x) {
  __m256 sq = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 r = _mm256_loadu_ps(residual + k);
    if (branch != nullptr) {
      r = _mm256_add_ps(r, _mm256_loadu_ps(branch + k));
      _mm256_storeu_ps(residual + k, r);
    }
    sq = _mm256_fmadd_ps(r, r, sq);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(hsum(sq) / static_cast<float>(K) + eps));
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(residual + k), inv);
    _mm256_storeu_ps(x + k, _mm256_mul_ps(normed, _mm256_loadu_ps(weight + k)));
  }
}

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
      modelship::quantize_row(row, K, w.G, a.q.data() + t * K, a.d.data() + t * groups,
                              a.qsum.data() + t * groups);
    }
  });
}

// out [T, N] = T rows, each made by `make_row(t, buf)` (as in `quantize_rows`), times the
// projection: quantized to int8 into `a` for W4A8, gathered as fp32 into `rows` for dense.
template <typename MakeRow>
void project(int64_t T, const Projection& p, QuantizedActivations& a, std::vector<float>& rows,
             MakeRow make_row, float* out) {
  if (!p.is_dense) {
    quantize_rows(T, p.q4, a, make_row);
    modelship::q4_matmul(a, p.q4, T, out);
    return;
  }
  const int64_t K = p.dense.K;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* buf = rows.data() + t * K;
      const float* row = make_row(t, buf);
      if (row != buf) std::copy(row, row + K, buf);
    }
  });
  modelship::dense_matmul(rows.data(), p.dense, T, out);
}

}  // namespace

torch::Tensor decoder_layers(const torch::Tensor& hidden, at::TensorList weights,
                             const torch::Tensor& final_norm, at::TensorList kv_caches,
                             at::TensorList kv_scales, const torch::Tensor& cos,
                             const torch::Tensor& sin, const torch::Tensor& slot_mapping, const torch::Tensor& block_table,
                             const torch::Tensor& token_req, const torch::Tensor& token_pos,
                             int64_t block_size, int64_t num_heads, double eps, double scale) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() &&
                  (hidden.scalar_type() == at::kBFloat16 || hidden.scalar_type() == at::kFloat),
              "hidden: contiguous bf16 or fp32 [T, hidden]");
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(num_layers >= 1 && static_cast<int64_t>(weights.size()) ==
                                     num_layers * kTensorsPerLayer,
              "weights: ", kTensorsPerLayer, " tensors per layer, one KV cache per layer");
  const int64_t T = hidden.size(0), hidden_size = hidden.size(1);
  const torch::Tensor& kv0 = kv_caches[0];
  TORCH_CHECK(kv0.dim() == 4 && kv0.size(1) == 2, "kv caches: [num_slots, 2, KVH, D]");
  const bool int8_cache = kv0.scalar_type() == at::kChar;
  TORCH_CHECK(static_cast<int64_t>(kv_scales.size()) == (int8_cache ? num_layers : 0),
              "kv_scales: one per layer with int8 caches, none with fp32 ones");
  const int64_t num_slots = kv0.size(0), KVH = kv0.size(2), D = kv0.size(3), H = num_heads;
  TORCH_CHECK(D % 8 == 0 && D <= 256 && H % KVH == 0 && H / KVH <= 16,
              "head_dim a multiple of 8 (<= 256), at most 16 query heads per KV head");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(1) == D && cos.sizes() == sin.sizes(),
              "cos and sin: contiguous fp32 [max_positions, head_dim]");
  const int64_t qkv_width = (H + 2 * KVH) * D;
  const torch::Tensor& down0 = weights[kDownWeight];  // int4 [blocks, 4 I] or dense [N, I]
  const int64_t intermediate = down0.size(1) / (down0.scalar_type() == at::kByte ? 4 : 1);
  // the norm and SiLU loops run 8 columns at a time (int4 group sizes are multiples of 64)
  TORCH_CHECK(hidden_size % 8 == 0 && intermediate % 8 == 0,
              "hidden and intermediate sizes must be multiples of 8");

  std::vector<Layer> layers(num_layers);
  for (int64_t l = 0; l < num_layers; ++l) {
    const torch::Tensor* w = weights.data() + l * kTensorsPerLayer;
    const torch::Tensor& kv = kv_caches[l];
    TORCH_CHECK(kv.scalar_type() == (int8_cache ? at::kChar : at::kFloat) &&
                    kv.is_contiguous() && kv.sizes() == kv0.sizes(),
                "kv caches: contiguous, all fp32 or all int8, all of one shape");
    Layer& layer = layers[l];
    layer.input_norm = fp32_vector(w[kInputNorm], hidden_size, "input_norm");
    layer.qkv = projection(w + kQkvWeight, qkv_width, hidden_size, "qkv_proj");
    layer.qkv_bias = w[kQkvBias].numel() == 0
                         ? nullptr
                         : fp32_vector(w[kQkvBias], qkv_width, "qkv_proj bias");
    layer.o = projection(w + kOWeight, hidden_size, H * D, "o_proj");
    layer.post_norm = fp32_vector(w[kPostNorm], hidden_size, "post_attention_norm");
    layer.gate_up = projection(w + kGateUpWeight, 2 * intermediate, hidden_size, "gate_up_proj");
    layer.down = projection(w + kDownWeight, hidden_size, intermediate, "down_proj");
    layer.kv = nullptr;
    layer.kv_int8 = nullptr;
    layer.kv_scales = nullptr;
    if (int8_cache) {
      const torch::Tensor& scales = kv_scales[l];
      TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                      scales.dim() == 3 && scales.size(0) == num_slots && scales.size(1) == 2 &&
                      scales.size(2) == KVH,
                  "kv_scales: contiguous fp32 [num_slots, 2, KVH]");
      layer.kv_int8 = kv.data_ptr<int8_t>();
      layer.kv_scales = scales.data_ptr<float>();
    } else {
      layer.kv = kv.data_ptr<float>();
    }
  }
  const float* final_weight = fp32_vector(final_norm, hidden_size, "final_norm");

  modelship::PagedStep step{T,
                            nullptr,
                            nullptr,
                            block_table.size(0),
                            block_table.dim() == 2 ? block_table.size(1) : 0,
                            nullptr,
                            nullptr,
                            block_size};
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == T,
              "slot_mapping: contiguous int64 [T]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() &&
                  block_table.dim() == 2,
              "block_table: contiguous int32 [R, W]");
  TORCH_CHECK(token_req.scalar_type() == at::kInt && token_pos.scalar_type() == at::kInt &&
                  token_req.is_contiguous() && token_pos.is_contiguous() &&
                  token_req.numel() == T && token_pos.numel() == T,
              "token_req and token_pos: contiguous int32 [T]");
  step.slot_mapping = slot_mapping.data_ptr<int64_t>();
  step.block_table = block_table.data_ptr<int32_t>();
  step.token_req = token_req.data_ptr<int32_t>();
  step.token_pos = token_pos.data_ptr<int32_t>();
  modelship::check_paged_step(step, num_slots);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(step.token_pos[t] < cos.size(0), "position beyond the RoPE tables");
  }

  auto out = torch::empty({T, hidden_size}, hidden.options());
  if (T == 0) return out;
  // fp32 rows of the step, reused by every layer
  const auto embedded = hidden.to(at::kFloat).contiguous();
  std::vector<float> residual(embedded.data_ptr<float>(),
                              embedded.data_ptr<float>() + T * hidden_size);
  std::vector<float> branch(T * hidden_size);  // o_proj, then down_proj output
  std::vector<float> qkv(T * qkv_width), q(T * H * D), attn(T * H * D);
  std::vector<float> gate_up(T * 2 * intermediate);
  const int64_t max_k = std::max({hidden_size, H * D, intermediate});
  QuantizedActivations a;
  a.q.resize(T * max_k);
  a.d.resize(T * (max_k / 64));  // group sizes are multiples of 64
  a.qsum.resize(T * (max_k / 64));
  std::vector<float> rows(T * max_k);  // a dense projection's fp32 input
  const float feps = static_cast<float>(eps), fscale = static_cast<float>(scale);

  for (int64_t l = 0; l < num_layers; ++l) {
    const Layer& layer = layers[l];
    // The previous layer's down output joins the residual stream here (none before layer 0).
    const float* previous = l == 0 ? nullptr : branch.data();
    project(T, layer.qkv, a, rows, [&](int64_t t, float* buf) {
      add_rmsnorm(residual.data() + t * hidden_size,
                  previous ? previous + t * hidden_size : nullptr, layer.input_norm,
                  hidden_size, feps, buf);
      return buf;
    }, qkv.data());  // [T, (H + 2 KVH) D]
    if (layer.qkv_bias != nullptr) {
      for (int64_t t = 0; t < T; ++t) {
        float* row = qkv.data() + t * qkv_width;
        for (int64_t i = 0; i < qkv_width; ++i) row[i] += layer.qkv_bias[i];
      }
    }
    attend(layer, qkv.data(), step, cos.data_ptr<float>(), sin.data_ptr<float>(), H, KVH, D,
           fscale, q.data(), attn.data());
    project(T, layer.o, a, rows, [&](int64_t t, float*) { return attn.data() + t * H * D; },
            branch.data());  // [T, hidden]
    project(T, layer.gate_up, a, rows, [&](int64_t t, float* buf) {
      add_rmsnorm(residual.data() + t * hidden_size, branch.data() + t * hidden_size,
                  layer.post_norm, hidden_size, feps, buf);
      return buf;
    }, gate_up.data());  // [T, 2 I]: gate | up
    project(T, layer.down, a, rows, [&](int64_t t, float* buf) {
      const float* row = gate_up.data() + t * 2 * intermediate;
      silu_mul(row, row + intermediate, intermediate, buf);
      return buf;
    }, branch.data());  // [T, hidden]
  }

  const bool is_bf16 = hidden.scalar_type() == at::kBFloat16;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> normed(hidden_size);
    for (int64_t t = begin; t < end; ++t) {
      add_rmsnorm(residual.data() + t * hidden_size, branch.data() + t * hidden_size,
                  final_weight, hidden_size, feps, normed.data());
      if (is_bf16) {
        auto* dst = out.data_ptr<c10::BFloat16>() + t * hidden_size;
        for (int64_t k = 0; k < hidden_size; ++k) dst[k] = c10::BFloat16(normed[k]);
      } else {
        std::copy(normed.begin(), normed.end(), out.data_ptr<float>() + t * hidden_size);
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(modelship, m) {
  m.def(
      "decoder_layers(Tensor hidden, Tensor[] weights, Tensor final_norm, Tensor(a!)[] kv_caches, "
      "Tensor(b!)[] kv_scales, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_table, "
      "Tensor token_req, Tensor token_pos, int block_size, int num_heads, float eps, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(modelship, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
