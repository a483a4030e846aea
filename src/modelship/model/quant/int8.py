"""An int8 output head: W8A8 on modelship's AVX2 kernel (`cpu_kernels.q8_linear`).

The vocabulary projection is the largest matmul of a small model's decode step (SmolLM2:
49152 x 576). In bf16 on a CPU without native bf16 it costs more than all the int4 layers
together at batch 16; int8 weights (symmetric, one scale per vocabulary row) times int8
activations (per group of 64 columns) halve the bytes read and run in integers.
"""

from __future__ import annotations

import torch
from torch import nn

from modelship.model import cpu_kernels

ACTIVATION_GROUP = 64
LM_HEADS = ("auto", "int8", "int4", "dense")  # `load_model(lm_head=...)`; int4: `int4_head`


def int8_head_supports(in_features: int) -> bool:
    return in_features % ACTIVATION_GROUP == 0


class W8A8Linear(nn.Module):
    """y = x W^T with W int8 [out, in] and fp32 scales [out]; fp32 output [n, out]."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> W8A8Linear:  # [out, in]
        if not int8_head_supports(weight.shape[1]):
            raise ValueError(f"in_features {weight.shape[1]} is not a multiple of 64")
        return cls(*cpu_kernels.pack_q8(weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out] fp32
        if x.dtype not in (torch.bfloat16, torch.float32):
            x = x.float()
        return cpu_kernels.q8_linear(x.contiguous(), self.qweight, self.scales, ACTIVATION_GROUP)
