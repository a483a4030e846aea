// The fused decoder's mixture-of-experts MLP (`mlp_cpu.h`), and the projection and gated
// MLP constructors it shares with `decoder_cpu.cpp`.
//
// Routing, per token, as `model/moe.py` (and transformers) does it: router logits x W_g^T in
// fp32 (the router weight is never quantized), softmax in fp32 over all experts, the top-k
// (descending probability; ties go to the lower expert), renormalized over the k when the
// family asks. Dispatch: the step's (token, expert) pairs are grouped by expert, tokens in
// ascending order within each, and every active expert runs once on its group of rows
// (gate_up -> silu * up -> down, W4A8 or dense). The weighted rows are added to their
// tokens' outputs in ascending expert order, so a token's output is summed in ascending
// expert order from zero: the same bits whatever else is in the batch, since each expert's
// matmuls compute a row on its own.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "mlp_cpu.h"

namespace modelship {

Projection projection(const torch::Tensor* t, int64_t N, int64_t K, const char* name) {
  if (t[0].scalar_type() != at::kByte) return {{}, dense_weight(t[0], N, K, name), true};
  Q4Weight w = q4_weight(t[0], t[1], t[2], K, name);
  TORCH_CHECK(w.N == (N + 7) / 8 * 8, name, ": ", (N + 7) / 8, " blocks of 8 rows for N = ", N);
  w.N = N;
  return {w, {}, false};
}

GatedMlp gated_mlp(const torch::Tensor* t, int64_t hidden, const char* name) {
  const torch::Tensor& down = t[3];  // int4 [blocks, 4 I] or dense [hidden, I]
  TORCH_CHECK(down.dim() == 2, name, ": down_proj must be 2-D");
  const int64_t I = down.size(1) / (down.scalar_type() == at::kByte ? 4 : 1);
  // the SiLU loop runs 8 columns at a time (int4 group sizes are multiples of 64)
  TORCH_CHECK(I % 8 == 0, name, ": intermediate size must be a multiple of 8, got ", I);
  return {projection(t, 2 * I, hidden, name), projection(t + 3, hidden, I, name), I};
}

namespace {

constexpr float kTaken = -1.0f;  // below every probability
// Steps of at most this many rows run their experts side by side (`moe_forward`). Either way
// a row gets the same bits: the matmuls compute a row alike however rows and outputs are
// split over threads.
constexpr int64_t kSideBySideRows = 16;

// One token's top_k experts (descending probability, ties to the lower expert) and their
// weights, from its E router logits; probs: E floats of scratch.
void route_row(const float* logits, int64_t E, const Routing& routing, float* probs,
               int64_t* experts, float* weights) {
  float max = logits[0];
  for (int64_t e = 1; e < E; ++e) max = std::max(max, logits[e]);
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) {
    probs[e] = std::exp(logits[e] - max);
    sum += probs[e];
  }
  for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
  float total = 0.0f;
  for (int64_t j = 0; j < routing.top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      if (probs[e] != kTaken && (best < 0 || probs[e] > probs[best])) best = e;
    }
    experts[j] = best;
    weights[j] = probs[best];
    total += probs[best];
    probs[best] = kTaken;
  }
  if (routing.normalize) {
    for (int64_t j = 0; j < routing.top_k; ++j) weights[j] /= total;
  }
}

// dst [hidden] += w * src [hidden]: a product, then a sum (no FMA), as torch's mul then add.
inline void add_scaled(float* dst, const float* src, float w, int64_t hidden) {
  const __m256 wv = _mm256_set1_ps(w);
  for (int64_t k = 0; k < hidden; k += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(src + k), wv);
    _mm256_storeu_ps(dst + k, _mm256_add_ps(_mm256_loadu_ps(dst + k), y));
  }
}

}  // namespace

void moe_forward(const MoE& moe, const Routing& routing, const float* x, int64_t T,
                 int64_t hidden, ProjectionScratch& s, float* gate_up, float* out) {
  const int64_t E = moe.router.N, k = routing.top_k;
  std::vector<float> logits(T * E);
  dense_matmul(x, moe.router, T, logits.data());  // [T, E]
  std::vector<int64_t> choice(T * k);  // pair p = token p / k, its (p % k)-th choice
  std::vector<float> weight(T * k);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(E);
    for (int64_t t = begin; t < end; ++t) {
      route_row(logits.data() + t * E, E, routing, probs.data(), choice.data() + t * k,
                weight.data() + t * k);
    }
  });

  // The pairs grouped by expert (a counting sort), tokens ascending within each group.
  std::vector<int64_t> offsets(E + 1, 0);
  for (int64_t p = 0; p < T * k; ++p) ++offsets[choice[p] + 1];
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1), tokens(T * k);
  std::vector<float> token_weight(T * k);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t slot = fill[choice[p]]++;
    tokens[slot] = p / k;
    token_weight[slot] = weight[p];
  }

  std::fill(out, out + T * hidden, 0.0f);
  std::vector<float> expert_out;  // [pairs, hidden] or [T, hidden]: see below
  auto run_expert = [&](int64_t e, ProjectionScratch& scratch, float* up, float* result) {
    const int64_t* group = tokens.data() + offsets[e];
    run_gated_mlp(offsets[e + 1] - offsets[e], moe.experts[e], scratch, up,
                  [&](int64_t i, float*) { return x + group[i] * hidden; }, result);
  };
  if (T <= kSideBySideRows) {
    // Decode: a few rows per expert. The active experts run side by side, each on one
    // thread with its matmuls inline (one parallel region a layer instead of two per
    // expert), into their own rows of `expert_out`; the sums follow in expert order.
    std::vector<int64_t> active;
    for (int64_t e = 0; e < E; ++e) {
      if (offsets[e + 1] > offsets[e]) active.push_back(e);
    }
    expert_out.resize(T * k * hidden);
    at::parallel_for(0, static_cast<int64_t>(active.size()), 1, [&](int64_t begin, int64_t end) {
      int64_t width = 0;
      for (int64_t i = begin; i < end; ++i) {
        width = std::max(width, moe.experts[active[i]].intermediate);
      }
      ProjectionScratch scratch(T, std::max(hidden, width));
      std::vector<float> up(T * 2 * width);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t e = active[i];
        run_expert(e, scratch, up.data(), expert_out.data() + offsets[e] * hidden);
      }
    });
    for (int64_t p = 0; p < T * k; ++p) {  // pairs in expert order
      add_scaled(out + tokens[p] * hidden, expert_out.data() + p * hidden, token_weight[p],
                 hidden);
    }
  } else {
    // Prefill: each expert has rows enough to share out; experts one after the other.
    expert_out.resize(T * hidden);  // an expert sees each token at most once
    for (int64_t e = 0; e < E; ++e) {
      if (offsets[e + 1] == offsets[e]) continue;
      run_expert(e, s, gate_up, expert_out.data());
      for (int64_t p = offsets[e]; p < offsets[e + 1]; ++p) {
        add_scaled(out + tokens[p] * hidden, expert_out.data() + (p - offsets[e]) * hidden,
                   token_weight[p], hidden);
      }
    }
  }

  if (moe.has_shared) {
    expert_out.resize(std::max(T * hidden, static_cast<int64_t>(expert_out.size())));
    std::vector<float> gate(T);
    dense_matmul(x, moe.shared_gate, T, gate.data());  // [T, 1]
    run_gated_mlp(T, moe.shared, s, gate_up,
                  [&](int64_t t, float*) { return x + t * hidden; }, expert_out.data());
    for (int64_t t = 0; t < T; ++t) {
      const float g = 1.0f / (1.0f + std::exp(-gate[t]));
      add_scaled(out + t * hidden, expert_out.data() + t * hidden, g, hidden);
    }
  }
}

}  // namespace modelship
