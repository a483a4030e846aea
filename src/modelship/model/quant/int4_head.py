"""A 4-bit output head (and tied embedding) on the W4A8 kernel (`quant.int4.W4A8Linear`).

The vocabulary projection is a large share of what a small model's decode step reads:
SmolLM2-135M's tied 49152 x 576 head is 28 MB of ~146 MB in int8 (`quant.int8`), 16 MB as
4-bit weights with an fp16 scale and minimum per group of 64 columns. The checkpoint's
16-bit head is quantized at load time by round-to-nearest, asymmetric per group (each
group's range split in 15 steps; no calibration data), so any checkpoint can take it;
whether its quality holds is measured, not assumed: select scores it as a candidate of its
own (`pipeline.select.candidates`) and a release records the choice it was measured with.

With tied embeddings the lookup reads its rows from the same packed weights
(`cpu_kernels.dequantize_q4_rows`: only the looked-up rows), and the 16-bit table is
dropped: the model then holds one 4-bit copy of the matrix instead of a 16-bit table plus
an int8 head.
"""

from __future__ import annotations

import torch
from torch import nn

from modelship.model import cpu_kernels
from modelship.model.quant.int4 import W4A8Linear

HEAD_GROUP_SIZE = 64  # columns per scale and minimum: the demo model's int4 variants' too


def int4_head_supports(out_features: int, in_features: int) -> bool:
    return cpu_kernels.supports(out_features, in_features, HEAD_GROUP_SIZE)


def quantize_rtn(
    weight: torch.Tensor,  # [out, in] float
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (u [out, in] int32 in [0, 15], scale [out, in / group_size], zero_point the
    same) in `quant.int4`'s convention W = (u - 8 - zero_point) * scale: per group, min and
    max of the weights, scale = (max - min) / 15 and u = round((w - min) / scale), with
    scale and min rounded to fp16 first (what `pack_q4` stores), so u is the nearest step
    of the grid the kernel computes with. A constant group keeps its value exactly (u 0)."""
    out_features, in_features = weight.shape
    grouped = weight.float().view(out_features, in_features // group_size, group_size)
    low = grouped.amin(-1).half().float()  # [out, groups]
    scale = ((grouped.amax(-1) - low) / 15).half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant: u = 0 gives low
    u = ((grouped - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp_(0, 15)
    zero_point = -low / scale - 8  # so that -(8 + zero_point) * scale = low
    return u.view(out_features, in_features).to(torch.int32), scale, zero_point


class Int4Head(nn.Module):
    """Logits from a 4-bit copy of the output head ([vocab, hidden] on `W4A8Linear`), and
    rows of it as embeddings. Batch-invariant as the kernel is: each row's logits are the
    same whatever else is in the step."""

    def __init__(self, linear: W4A8Linear) -> None:
        super().__init__()
        self.linear = linear

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> Int4Head:  # [out, in]
        out_features, in_features = weight.shape
        if not int4_head_supports(out_features, in_features):
            raise ValueError(f"in_features {in_features} is not a multiple of {HEAD_GROUP_SIZE}")
        u, scale, zero_point = quantize_rtn(weight, HEAD_GROUP_SIZE)
        return cls(W4A8Linear.from_unpacked(u, scale, zero_point, HEAD_GROUP_SIZE, None))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out] fp32
        # fp32 in, fp32 out: the kernel writes its output in the activations' dtype
        return self.linear(hidden.float())

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, in] fp32
        """The weight's rows `token_ids`, dequantized (those rows only)."""
        linear = self.linear
        return cpu_kernels.dequantize_q4_rows(
            linear.qweight, linear.scales, linear.mins, token_ids.long()
        )
