// Paged attention for CPUs with AVX2, reading keys and values straight from the block pool.
//
// Every query token attends to its request's positions 0 .. pos, visited KV block by KV block
// in position order with an online softmax. A query's result therefore depends only on the
// query and those keys: not on how many other tokens share the step, nor on whether its
// prompt was computed in one chunk, in several, or partly taken from the prefix cache. That
// is what makes greedy decoding repeatable across batch compositions and cache hits.
//
//   q            [T, H, D] fp32 (rotated), contiguous
//   kv           [num_slots, 2, KVH, D] fp32 or int8: slot = block_id * block_size + offset
//   kv_scales    [num_slots, 2, KVH] fp32 for an int8 kv (one per head vector), else none
//   block_table  [R, W] int32: physical blocks of each request
//   token_req    [T] int32: the request of each query token
//   token_pos    [T] int32: the position of each query token (attends 0 .. pos)
//   window       0, or a sliding window: the query attends pos - window + 1 .. pos only
//                (Mistral v0.1, Gemma's local layers); blocks wholly before it are not read
//   -> out       [T, H, D] fp32

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace {

using modelship::exp8;
using modelship::hsum;
using modelship::load8;
using modelship::PagedKV;

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 16;  // query heads per KV head

// q . k for a float or int8 key (int8: not yet times its scale)
template <typename T>
inline float dot(const float* a, const T* b, int D) {
  __m256 acc = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b + d), acc);
  }
  return hsum(acc);
}

// One head vector -> int8 and its scale, as `kv_cache.quantize_kv`: s = absmax / 127,
// q = round(x / s) to nearest even. A vector with a NaN or infinity gets a NaN scale, so
// what reads it stays non-finite (and the sampler refuses the row).
inline void quantize_head(const float* x, int64_t D, int8_t* out, float* scale) {
  float absmax = 0.0f;
  bool finite = true;
  for (int64_t d = 0; d < D; ++d) {
    const float m = std::fabs(x[d]);
    finite = finite && std::isfinite(m);
    absmax = std::max(absmax, m);
  }
  const float s = absmax / 127.0f;
  const float inv = finite && s > 0.0f ? 1.0f / s : 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    out[d] = static_cast<int8_t>(std::clamp(std::nearbyint(x[d] * inv), -127.0f, 127.0f));
  }
  *scale = finite ? s : std::numeric_limits<float>::quiet_NaN();
}

void check_shapes(int64_t H, int64_t KVH, int64_t D) {
  TORCH_CHECK(D % 8 == 0 && D <= kMaxHeadDim, "head_dim: a multiple of 8, <= 256");
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kMaxGroup, "query heads per KV head: at most 16");
}

modelship::PagedStep paged_step(const torch::Tensor& slot_mapping,
                                const torch::Tensor& block_table, const torch::Tensor& token_req,
                                const torch::Tensor& token_pos, int64_t block_size) {
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() &&
                  block_table.dim() == 2,
              "block_table: int32 [R, W]");
  TORCH_CHECK(token_req.scalar_type() == at::kInt && token_pos.scalar_type() == at::kInt &&
                  token_req.is_contiguous() && token_pos.is_contiguous(),
              "token_req and token_pos: contiguous int32");
  const int64_t T = token_pos.numel();
  TORCH_CHECK(token_req.numel() == T, "one request and position per token");
  const int64_t* slots = nullptr;
  if (slot_mapping.defined()) {
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                    slot_mapping.numel() == T,
                "slot_mapping: contiguous int64, one slot per token");
    slots = slot_mapping.data_ptr<int64_t>();
  }
  return {T,
          slots,
          block_table.data_ptr<int32_t>(),
          block_table.size(0),
          block_table.size(1),
          token_req.data_ptr<int32_t>(),
          token_pos.data_ptr<int32_t>(),
          block_size};
}

}  // namespace

namespace modelship {

void check_paged_step(const PagedStep& step, int64_t num_slots) {
  TORCH_CHECK(step.block_size >= 1 && num_slots % step.block_size == 0,
              "num_slots: whole blocks");
  const int64_t num_blocks = num_slots / step.block_size;
  for (int64_t i = 0; i < step.num_requests * step.width; ++i) {
    TORCH_CHECK(step.block_table[i] >= 0 && step.block_table[i] < num_blocks,
                "block id out of range");
  }
  for (int64_t t = 0; t < step.num_tokens; ++t) {
    TORCH_CHECK(step.token_req[t] >= 0 && step.token_req[t] < step.num_requests,
                "token_req out of range");
    TORCH_CHECK(step.token_pos[t] >= 0 && step.token_pos[t] / step.block_size < step.width,
                "token_pos beyond the block table");
    TORCH_CHECK(step.slot_mapping == nullptr ||
                    (step.slot_mapping[t] >= 0 && step.slot_mapping[t] < num_slots),
                "slot_mapping out of range");
  }
}

template <typename T>
void rope_write_kv(const float* qkv, const PagedStep& step, const float* cos, const float* sin,
                   int64_t H, int64_t KVH, int64_t D, float* q, PagedKV<T> cache) {
  constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  T* kv = cache.values;
  const int64_t width = (H + 2 * KVH) * D, half = D / 2;
  const int64_t* slots = step.slot_mapping;
  const int32_t* pos = step.token_pos;
  at::parallel_for(0, step.num_tokens, 16, [&](int64_t begin, int64_t end) {
    alignas(32) float rotated[kMaxHeadDim];  // int8: a k head before its quantization
    for (int64_t t = begin; t < end; ++t) {
      const float* row = qkv + t * width;
      const float* c = cos + pos[t] * D;
      const float* sn = sin + pos[t] * D;
      for (int64_t h = 0; h < H + KVH; ++h) {  // q heads, then k heads: rotated
        const float* x = row + h * D;
        const int64_t k_vector = (slots[t] * 2 + 0) * KVH + (h - H);  // for h >= H
        float* dst;
        if constexpr (kInt8) {
          dst = h < H ? q + (t * H + h) * D : rotated;
        } else {
          dst = h < H ? q + (t * H + h) * D : kv + k_vector * D;
        }
        for (int64_t d = 0; d < D; ++d) dst[d] = x[d] * c[d] + x[(d + half) % D] * sn[d];
        if constexpr (kInt8) {
          if (h >= H) quantize_head(rotated, D, kv + k_vector * D, cache.scales + k_vector);
        }
      }
      for (int64_t h = 0; h < KVH; ++h) {  // v heads: copied (int8: quantized)
        const int64_t v_vector = (slots[t] * 2 + 1) * KVH + h;
        const float* x = row + (H + KVH + h) * D;
        if constexpr (kInt8) {
          quantize_head(x, D, kv + v_vector * D, cache.scales + v_vector);
        } else {
          float* dst = kv + v_vector * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = x[d];
        }
      }
    }
  });
}

}  // namespace modelship

namespace {

// `modelship::paged_attention_rows` with a sliding window (0: none); kept out of
// cpu_kernels.h so that the fused decoder's call stays as it is (it declines windowed models).
template <typename T>
void windowed_attention_rows(const float* qp, PagedKV<T> cache, const modelship::PagedStep& step,
                             int64_t H, int64_t KVH, int64_t D, float scale, int64_t window,
                             float* op) {
  constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  const T* kvp = cache.values;
  const float* kv_scales = cache.scales;  // [num_slots, 2, KVH], int8 only
  const int64_t group = H / KVH, width = step.width, block_size = step.block_size;
  const int32_t* table = step.block_table;
  const int32_t* req = step.token_req;
  const int32_t* pos = step.token_pos;
  at::parallel_for(0, step.num_tokens * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(block_size + 8);
    alignas(32) float acc[kMaxGroup][kMaxHeadDim];
    float run_max[kMaxGroup], run_sum[kMaxGroup];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / KVH, h_kv = task % KVH;
      const int32_t* blocks = table + static_cast<int64_t>(req[t]) * width;
      const int64_t last = pos[t];
      const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      for (int64_t g = 0; g < group; ++g) {
        run_max[g] = -std::numeric_limits<float>::infinity();
        run_sum[g] = 0.0f;
        for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.0f;
      }
      for (int64_t b = first / block_size; b * block_size <= last; ++b) {
        // keys first .. last of block b: `n` of them from offset `skip` (scores[0] is `skip`)
        const int64_t skip = std::max<int64_t>(0, first - b * block_size);
        const int64_t n = std::min(block_size, last - b * block_size + 1) - skip;
        const int64_t base_slot = static_cast<int64_t>(blocks[b]) * block_size + skip;
        for (int64_t g = 0; g < group; ++g) {
          const float* qv = qp + (t * H + h_kv * group + g) * D;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < n; ++j) {
            const int64_t k_vector = (base_slot + j) * 2 * KVH + h_kv;
            const T* k = kvp + k_vector * D;
            if constexpr (kInt8) {
              scores[j] = dot(qv, k, D) * (kv_scales[k_vector] * scale);
            } else {
              scores[j] = dot(qv, k, D) * scale;
            }
            block_max = std::max(block_max, scores[j]);
          }
          const float new_max = std::max(run_max[g], block_max);
          const float rescale = std::exp(run_max[g] - new_max);  // 0 for the first block
          run_max[g] = new_max;
          const __m256 m = _mm256_set1_ps(new_max);
          __m256 sum = _mm256_setzero_ps();
          for (int64_t j = 0; j < n; j += 8) {
            const int64_t left = n - j;
            __m256 s = _mm256_loadu_ps(scores.data() + j);
            __m256 p = exp8(_mm256_sub_ps(s, m));
            if (left < 8) {  // zero the lanes past the block's last key
              const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
              const __m256 keep =
                  _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane));
              p = _mm256_and_ps(p, keep);
            }
            _mm256_storeu_ps(scores.data() + j, p);
            sum = _mm256_add_ps(sum, p);
          }
          run_sum[g] = run_sum[g] * rescale + hsum(sum);
          const __m256 r = _mm256_set1_ps(rescale);
          float* a = acc[g];
          for (int64_t d = 0; d < D; d += 8) {
            _mm256_store_ps(a + d, _mm256_mul_ps(_mm256_load_ps(a + d), r));
          }
          for (int64_t j = 0; j < n; ++j) {
            const int64_t v_vector = (base_slot + j) * 2 * KVH + KVH + h_kv;
            const T* v = kvp + v_vector * D;
            float weight = scores[j];
            if constexpr (kInt8) weight *= kv_scales[v_vector];
            const __m256 w = _mm256_set1_ps(weight);
            for (int64_t d = 0; d < D; d += 8) {
              _mm256_store_ps(a + d, _mm256_fmadd_ps(w, load8(v + d), _mm256_load_ps(a + d)));
            }
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = op + (t * H + h_kv * group + g) * D;
        const __m256 inv = _mm256_set1_ps(1.0f / run_sum[g]);
        for (int64_t d = 0; d < D; d += 8) {
          _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_load_ps(acc[g] + d), inv));
        }
      }
    }
  });
}

}  // namespace

namespace modelship {

template <typename T>
void paged_attention_rows(const float* qp, PagedKV<T> cache, const PagedStep& step, int64_t H,
                          int64_t KVH, int64_t D, float scale, float* op) {
  windowed_attention_rows(qp, cache, step, H, KVH, D, scale, 0, op);
}

template void rope_write_kv<float>(const float*, const PagedStep&, const float*, const float*,
                                   int64_t, int64_t, int64_t, float*, PagedKV<float>);
template void rope_write_kv<int8_t>(const float*, const PagedStep&, const float*, const float*,
                                    int64_t, int64_t, int64_t, float*, PagedKV<int8_t>);
template void paged_attention_rows<float>(const float*, PagedKV<float>, const PagedStep&,
                                          int64_t, int64_t, int64_t, float, float*);
template void paged_attention_rows<int8_t>(const float*, PagedKV<int8_t>, const PagedStep&,
                                           int64_t, int64_t, int64_t, float, float*);

}  // namespace modelship

namespace {

// kv: fp32 without scales, or int8 with fp32 scales [slots, 2, KVH].
void check_cache(const torch::Tensor& kv, const std::optional<torch::Tensor>& kv_scales) {
  TORCH_CHECK(kv.dim() == 4 && kv.is_contiguous() && kv.size(1) == 2 &&
                  (kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kChar),
              "kv: contiguous fp32 or int8 [slots, 2, KVH, D]");
  const bool has_scales = kv_scales.has_value() && kv_scales->defined();
  TORCH_CHECK(has_scales == (kv.scalar_type() == at::kChar),
              "kv_scales: given with an int8 kv, and only then");
  if (has_scales) {
    const torch::Tensor& s = *kv_scales;
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 3 &&
                    s.size(0) == kv.size(0) && s.size(1) == 2 && s.size(2) == kv.size(2),
                "kv_scales: contiguous fp32 [slots, 2, KVH]");
  }
}

// Calls f(PagedKV<float>) or f(PagedKV<int8_t>) for a cache that passed check_cache.
template <typename F>
void with_cache(const torch::Tensor& kv, const std::optional<torch::Tensor>& kv_scales, F f) {
  if (kv.scalar_type() == at::kChar) {
    f(PagedKV<int8_t>{kv.data_ptr<int8_t>(), kv_scales->data_ptr<float>()});
  } else {
    f(PagedKV<float>{kv.data_ptr<float>(), nullptr});
  }
}

}  // namespace

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& kv,
                              const std::optional<torch::Tensor>& kv_scales,
                              const torch::Tensor& block_table, const torch::Tensor& token_req,
                              const torch::Tensor& token_pos, int64_t block_size, double scale,
                              int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat,
              "q: contiguous fp32 [T, H, D]");
  check_cache(kv, kv_scales);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = kv.size(2);
  TORCH_CHECK(kv.size(3) == D, "q and kv: the same head_dim");
  check_shapes(H, KVH, D);
  const auto step = paged_step(torch::Tensor(), block_table, token_req, token_pos, block_size);
  TORCH_CHECK(step.num_tokens == T, "one request and position per token");
  modelship::check_paged_step(step, kv.size(0));
  TORCH_CHECK(window >= 0, "window: 0 (none) or positive");
  auto out = torch::empty_like(q);
  with_cache(kv, kv_scales, [&](auto cache) {
    windowed_attention_rows(q.data_ptr<float>(), cache, step, H, KVH, D,
                            static_cast<float>(scale), window, out.data_ptr<float>());
  });
  return out;
}

// One decoder layer's attention after its q/k/v projection, in one call: rotate q and k
// (RoPE in fp32, HF's rotate-half layout, tables with the sign folded into `sin`), write
// this step's k and v into the cache at `slot_mapping` (int8: quantized per head vector),
// then `paged_attention`.
//   qkv  [T, (H + 2 * KVH) * D] bf16 or fp32: q heads | k heads | v heads per token
//   cos, sin  [max_positions, D] fp32
//   -> [T, H * D] in qkv's dtype
torch::Tensor rope_paged_attention(const torch::Tensor& qkv, const torch::Tensor& kv,
                                   const std::optional<torch::Tensor>& kv_scales,
                                   const torch::Tensor& cos, const torch::Tensor& sin,
                                   const torch::Tensor& slot_mapping,
                                   const torch::Tensor& block_table,
                                   const torch::Tensor& token_req, const torch::Tensor& token_pos,
                                   int64_t block_size, double scale, int64_t num_heads,
                                   int64_t window) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv: contiguous [T, (H + 2 KVH) D]");
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 || qkv.scalar_type() == at::kFloat,
              "qkv: bf16 or fp32");
  check_cache(kv, kv_scales);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "cos and sin: contiguous fp32 [max_positions, D]");
  const int64_t T = qkv.size(0), KVH = kv.size(2), D = kv.size(3), H = num_heads;
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D, "qkv width must be (H + 2 KVH) * D");
  TORCH_CHECK(cos.size(1) == D, "cos/sin width must be head_dim");
  check_shapes(H, KVH, D);
  const auto step = paged_step(slot_mapping, block_table, token_req, token_pos, block_size);
  TORCH_CHECK(step.num_tokens == T, "one slot, request and position per token");
  modelship::check_paged_step(step, kv.size(0));
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(step.token_pos[t] < cos.size(0), "position beyond the RoPE tables");
  }
  TORCH_CHECK(window >= 0, "window: 0 (none) or positive");
  const auto qkv_f32 = qkv.to(at::kFloat);  // a no-op for fp32
  auto q = torch::empty({T, H, D}, qkv.options().dtype(at::kFloat));
  auto out = torch::empty({T, H * D}, qkv.options().dtype(at::kFloat));
  with_cache(kv, kv_scales, [&](auto cache) {
    modelship::rope_write_kv(qkv_f32.data_ptr<float>(), step, cos.data_ptr<float>(),
                             sin.data_ptr<float>(), H, KVH, D, q.data_ptr<float>(), cache);
    windowed_attention_rows(q.data_ptr<float>(), cache, step, H, KVH, D,
                            static_cast<float>(scale), window, out.data_ptr<float>());
  });
  return out.to(qkv.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(modelship, m) {
  m.def(
      "rope_paged_attention(Tensor qkv, Tensor(a!) kv, Tensor(b!)? kv_scales, Tensor cos, "
      "Tensor sin, Tensor slot_mapping, Tensor block_table, Tensor token_req, "
      "Tensor token_pos, int block_size, float scale, int num_heads, int window=0) -> Tensor");
  m.def(
      "paged_attention(Tensor q, Tensor kv, Tensor? kv_scales, Tensor block_table, "
      "Tensor token_req, Tensor token_pos, int block_size, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(modelship, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("rope_paged_attention", &rope_paged_attention);
}
