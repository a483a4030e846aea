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
//   x = rmsnorm(residual) -> int8 per group -> qkv (+ bias) [-> q/k rmsnorm] [-> clip]
//   -> RoPE, K/V write, attention -> int8 -> o_proj; residual += o; x = rmsnorm(residual)
//   -> the MLP: int8 -> gate_up -> silu(gate) * up -> int8 -> down, or a routed layer's
//   experts (`moe_cpu.cpp`); residual += MLP
// (a dense projection takes its fp32 rows as they are, without the int8 step)
// Every row is computed on its own: its norm, activation quantization and matmul
// reductions do not depend on the other rows or on how a prompt was chunked, so greedy
// decoding stays repeatable.
//
//   hidden   [T, hidden] bf16 or fp32: the embeddings of this step's tokens
//   weights  kTensorsPerLayer tensors per layer, in `LayerTensor` order (`fused_decoder.py`)
//   experts  the routed layers' experts, layer by layer, E x 6 tensors each (gate_up's
//            three, then down's: as the gate_up and down slots of `LayerTensor`)
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
#include "mlp_cpu.h"

namespace {

using modelship::hsum;
using modelship::project;
using modelship::projection;
using modelship::Projection;

// The tensors of one layer: norm weights, the q/k/v bias, q/k norm weights and the router
// fp32 (an empty tensor where the model has none), each projection as (qweight, scales,
// mins) of `pack_q4`, or dense as (weight [N, K] bf16/fp16/fp32, empty, empty).
//   q/k norm: [H D] and [KVH D] over the whole projection (OLMoE), or [D] per head (Qwen3)
//   gate_up, down: the dense MLP; in a routed layer the shared expert, or empty for none
//   router: a routed layer's [E, hidden]; shared_gate: its shared expert's [hidden]
enum LayerTensor : int64_t {
  kInputNorm,
  kQkvWeight, kQkvScales, kQkvMins, kQkvBias,
  kQNorm, kKNorm,
  kOWeight, kOScales, kOMins,
  kPostNorm,
  kGateUpWeight, kGateUpScales, kGateUpMins,
  kDownWeight, kDownScales, kDownMins,
  kRouter, kSharedGate,
  kTensorsPerLayer,
};

struct Layer {
  const float* input_norm;  // [hidden]
  Projection qkv;           // [(H + 2 KVH) D, hidden]
  const float* qkv_bias;    // [(H + 2 KVH) D] or null
  const float* q_norm;      // [H D] or [D] (per head), or null
  const float* k_norm;      // [KVH D] or [D] (per head), with q_norm
  bool qk_norm_per_head;
  Projection o;             // [hidden, H D]
  const float* post_norm;   // [hidden]
  bool is_moe;
  modelship::GatedMlp mlp;  // not is_moe: the layer's MLP
  modelship::MoE moe;       // is_moe
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

// q/k RMSNorm (whole q and k, or per head of width D) and clipping of one qkv row, in place.
void norm_and_clip_qkv(const Layer& layer, float* row, int64_t H, int64_t KVH, int64_t D,
                       float eps, float clip) {
  if (layer.q_norm != nullptr) {
    if (layer.qk_norm_per_head) {
      for (int64_t h = 0; h < H + KVH; ++h) {
        float* head = row + h * D;
        add_rmsnorm(head, nullptr, h < H ? layer.q_norm : layer.k_norm, D, eps, head);
      }
    } else {
      add_rmsnorm(row, nullptr, layer.q_norm, H * D, eps, row);
      add_rmsnorm(row + H * D, nullptr, layer.k_norm, KVH * D, eps, row + H * D);
    }
  }
  if (clip > 0.0f) {
    for (int64_t i = 0; i < (H + 2 * KVH) * D; ++i) row[i] = std::clamp(row[i], -clip, clip);
  }
}

// A tensor of fp32 [rows, hidden] as a dense weight for `dense_matmul`.
modelship::DenseWeight fp32_matrix(const torch::Tensor& t, int64_t hidden, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, ": fp32");
  return modelship::dense_weight(t, t.size(0), hidden, name);
}

}  // namespace

torch::Tensor decoder_layers(const torch::Tensor& hidden, at::TensorList weights,
                             at::TensorList experts, const torch::Tensor& final_norm,
                             at::TensorList kv_caches, at::TensorList kv_scales,
                             const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& slot_mapping, const torch::Tensor& block_table,
                             const torch::Tensor& token_req, const torch::Tensor& token_pos,
                             int64_t block_size, int64_t num_heads, int64_t top_k,
                             bool normalize_top_k, double eps, double scale, double clip_qkv) {
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
  // the norm loops run 8 columns at a time (int4 group sizes are multiples of 64)
  TORCH_CHECK(hidden_size % 8 == 0, "the hidden size must be a multiple of 8");
  int64_t max_intermediate = 0;  // the widest MLP or expert: the scratch buffers' width
  int64_t next_expert = 0;       // experts of the routed layers before this one

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
    layer.q_norm = layer.k_norm = nullptr;
    layer.qk_norm_per_head = w[kQNorm].numel() == D && w[kKNorm].numel() == D;
    if (w[kQNorm].numel() != 0) {
      layer.q_norm = fp32_vector(w[kQNorm], layer.qk_norm_per_head ? D : H * D, "q_norm");
      layer.k_norm = fp32_vector(w[kKNorm], layer.qk_norm_per_head ? D : KVH * D, "k_norm");
    }
    layer.o = projection(w + kOWeight, hidden_size, H * D, "o_proj");
    layer.post_norm = fp32_vector(w[kPostNorm], hidden_size, "post_attention_norm");
    layer.is_moe = w[kRouter].numel() != 0;
    if (!layer.is_moe) {
      layer.mlp = modelship::gated_mlp(w + kGateUpWeight, hidden_size, "mlp");
      max_intermediate = std::max(max_intermediate, layer.mlp.intermediate);
    } else {
      modelship::MoE& moe = layer.moe;
      moe.router = fp32_matrix(w[kRouter], hidden_size, "router");
      const int64_t E = moe.router.N;
      TORCH_CHECK(1 <= top_k && top_k <= E, "top_k must be in [1, ", E, "], got ", top_k);
      TORCH_CHECK(static_cast<int64_t>(experts.size()) >= (next_expert + E) * 6,
                  "experts: 6 tensors for each of the routed layers' experts");
      for (int64_t e = 0; e < E; ++e) {
        moe.experts.push_back(modelship::gated_mlp(experts.data() + (next_expert + e) * 6,
                                                   hidden_size, "expert"));
        max_intermediate = std::max(max_intermediate, moe.experts.back().intermediate);
      }
      next_expert += E;
      moe.has_shared = w[kGateUpWeight].numel() != 0;
      if (moe.has_shared) {
        moe.shared = modelship::gated_mlp(w + kGateUpWeight, hidden_size, "shared_expert");
        moe.shared_gate = fp32_matrix(w[kSharedGate], hidden_size, "shared_expert_gate");
        TORCH_CHECK(moe.shared_gate.N == 1, "shared_expert_gate: [1, hidden]");
        max_intermediate = std::max(max_intermediate, moe.shared.intermediate);
      }
    }
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
  TORCH_CHECK(static_cast<int64_t>(experts.size()) == next_expert * 6,
              "experts: 6 tensors for each of the routed layers' experts, no more");
  const float* final_weight = fp32_vector(final_norm, hidden_size, "final_norm");
  const modelship::Routing routing{top_k, normalize_top_k};

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
  std::vector<float> branch(T * hidden_size);  // o_proj, then the MLP's output
  std::vector<float> qkv(T * qkv_width), q(T * H * D), attn(T * H * D);
  std::vector<float> gate_up(T * 2 * max_intermediate);
  std::vector<float> mlp_input(T * hidden_size);  // a routed layer's normed rows
  modelship::ProjectionScratch scratch(T, std::max({hidden_size, H * D, max_intermediate}));
  const float feps = static_cast<float>(eps), fscale = static_cast<float>(scale);
  const float fclip = static_cast<float>(clip_qkv);

  for (int64_t l = 0; l < num_layers; ++l) {
    const Layer& layer = layers[l];
    // The previous layer's down output joins the residual stream here (none before layer 0).
    const float* previous = l == 0 ? nullptr : branch.data();
    project(T, layer.qkv, scratch, [&](int64_t t, float* buf) {
      add_rmsnorm(residual.data() + t * hidden_size,
                  previous ? previous + t * hidden_size : nullptr, layer.input_norm,
                  hidden_size, feps, buf);
      return buf;
    }, qkv.data());  // [T, (H + 2 KVH) D]
    for (int64_t t = 0; t < T; ++t) {
      float* row = qkv.data() + t * qkv_width;
      if (layer.qkv_bias != nullptr) {
        for (int64_t i = 0; i < qkv_width; ++i) row[i] += layer.qkv_bias[i];
      }
      norm_and_clip_qkv(layer, row, H, KVH, D, feps, fclip);
    }
    attend(layer, qkv.data(), step, cos.data_ptr<float>(), sin.data_ptr<float>(), H, KVH, D,
           fscale, q.data(), attn.data());
    project(T, layer.o, scratch, [&](int64_t t, float*) { return attn.data() + t * H * D; },
            branch.data());  // [T, hidden]
    auto post_norm = [&](int64_t t, float* buf) {
      add_rmsnorm(residual.data() + t * hidden_size, branch.data() + t * hidden_size,
                  layer.post_norm, hidden_size, feps, buf);
      return buf;
    };
    if (!layer.is_moe) {
      modelship::run_gated_mlp(T, layer.mlp, scratch, gate_up.data(), post_norm, branch.data());
      continue;
    }
    // the router and every expert read the normed rows: made once
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) post_norm(t, mlp_input.data() + t * hidden_size);
    });
    modelship::moe_forward(layer.moe, routing, mlp_input.data(), T, hidden_size, scratch,
                           gate_up.data(), branch.data());  // [T, hidden]
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
      "decoder_layers(Tensor hidden, Tensor[] weights, Tensor[] experts, Tensor final_norm, "
      "Tensor(a!)[] kv_caches, Tensor(b!)[] kv_scales, Tensor cos, Tensor sin, "
      "Tensor slot_mapping, Tensor block_table, Tensor token_req, Tensor token_pos, "
      "int block_size, int num_heads, int top_k, bool normalize_top_k, float eps, "
      "float scale, float clip_qkv) -> Tensor");
}

TORCH_LIBRARY_IMPL(modelship, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
