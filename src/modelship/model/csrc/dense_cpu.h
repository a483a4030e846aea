// The dense matmul the fused decoder (`decoder_cpu.cpp`) and the `dense_linear` op
// (`dense_cpu.cpp`) share: bf16, fp16 or fp32 weights widened to fp32 in registers, fp32
// accumulation. Needs AVX2 + FMA + F16C.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace modelship {

enum class DenseType { kBFloat16, kHalf, kFloat };

// W [N, K], row-major, in the checkpoint's (or compute) dtype.
struct DenseWeight {
  const void* data;
  DenseType type;
  int64_t N, K;
};

// `w` checked as a contiguous bf16, fp16 or fp32 [N, K] tensor (TORCH_CHECK naming `name`).
DenseWeight dense_weight(const at::Tensor& w, int64_t N, int64_t K, const char* name);

// out [M, N] fp32 = x [M, K] fp32 W^T. Parallel over N. Every output is one 8-lane fp32 FMA
// chain over K in column order, summed across lanes in one fixed order, whatever M is and
// however rows and columns are tiled: a row's result never depends on the other rows.
void dense_matmul(const float* x, const DenseWeight& w, int64_t M, float* out);

}  // namespace modelship
