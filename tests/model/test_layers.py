"""Building blocks against their textbook definitions."""

from __future__ import annotations

import pytest
import torch

from modelship.model import ModelConfig
from modelship.model.layers import RMSNorm, RotaryEmbedding, apply_rope_
from modelship.model.quant.base import dense_linear

CONFIG = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "vocab_size": 10,
    }
)


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.double()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("rows", [1, 5])  # one row takes the layer_norm path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=gen) + 0.5)
    norm.to(dtype).finish_loading()
    x = (torch.randn(rows, 48, generator=gen) * 3).to(dtype)
    out = norm(x)
    assert out.shape == x.shape and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        out.double(), ref_rms_norm(x, norm.weight, 1e-5), atol=tolerance, rtol=tolerance
    )


def test_rope_matches_rotate_half_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    rotary = RotaryEmbedding(CONFIG, max_positions=64, device=torch.device("cpu"))
    positions = torch.tensor([0, 3, 63])
    x = torch.randn(3, 5, 16, generator=gen)
    expected_input = x.clone()
    cos, sin = rotary.tables(positions, torch.float32)
    apply_rope_(x, cos, sin)
    # HF: x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]
    angles = positions[:, None].double() * (10000.0 ** (-torch.arange(0, 16, 2) / 16)).double()
    full = torch.cat([angles, angles], -1)[:, None, :]
    x1, x2 = expected_input.double().chunk(2, -1)
    expected = expected_input.double() * full.cos() + torch.cat([-x2, x1], -1) * full.sin()
    torch.testing.assert_close(x.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [2, 40])
def test_dense_linear_fp32_detour(rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    weight = torch.randn(9000, 64, generator=gen).bfloat16()  # > one upcast chunk of rows
    bias = torch.randn(9000, generator=gen).bfloat16()
    expected = x.double() @ weight.double().t() + bias.double()
    out = dense_linear(x, weight, bias, upcast_rows=32, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (rows, 9000)
    torch.testing.assert_close(out.double(), expected, atol=0.1, rtol=0.02)
