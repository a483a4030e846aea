"""Building blocks: RMSNorm, rotary embeddings (incl. llama3 and LongRoPE scaling), gated
MLP; the linear-module factory the loader hands to model constructors."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from modelship.model.config import ModelConfig

# (checkpoint prefixes of projections sharing an input, has bias) -> one module computing
# all of them, outputs concatenated in prefix order. It holds its weights already.
LinearFactory = Callable[[list[str], bool], nn.Module]


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, statistics in fp32 (as HF computes them)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.size = size
        self.doubled_weight: torch.Tensor | None = None  # [2 * size], set by finish_loading

    def finish_loading(self) -> None:
        """Derive the single-row fast path's weight; the loader calls this once `weight`
        holds the checkpoint's values."""
        self.doubled_weight = torch.cat([self.weight, self.weight])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, ..., size]
        if self.doubled_weight is not None:
            # layer_norm([x, -x]) = [x, -x] / rms(x): mean 0, variance mean(x^2). One fused
            # kernel instead of rms_norm's eight small ops (measured 10 vs 23 us for one
            # 576-wide row, 61 norms per decode step). Taken for every batch size, so a
            # row is normalized the same way alone or in a batch (deterministic greedy).
            doubled = torch.cat([x, -x], dim=-1)
            normed = F.layer_norm(doubled, doubled.shape[-1:], self.doubled_weight, None, self.eps)
            return normed[..., : self.size].contiguous()  # a no-op for a single row
        return F.rms_norm(x, (self.size,), self.weight, self.eps)


def _wavelength_base(config: ModelConfig) -> torch.Tensor:
    """theta^(2i / head_dim), [head_dim / 2]: the inverse of the unscaled frequencies."""
    dim = config.head_dim
    # fp32 as transformers computes it, so positions rotate identically
    return config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def rope_angles(
    config: ModelConfig, max_positions: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, float]:
    """(angles [max_positions, head_dim / 2] fp32, magnitude of cos and sin).

    LongRoPE (Phi-3 "su"/"longrope") divides each frequency by a per-frequency factor: the
    short factors for positions below `original_max_position_embeddings`, the long ones from
    there on, and scales cos and sin by sqrt(1 + ln(s) / ln(original)) with s = factor (default
    max_position_embeddings / original) unless `attention_factor` is given. The choice is per
    position, not per sequence, so a key's rotation never changes once it is in the paged
    cache (and prefix-cache blocks stay valid): equal to transformers for every sequence
    within the original length, and to its forward with a kept KV cache past it. Its
    `generate` instead recomputes the whole sequence with the long factors once it grows
    past the original length; we do not (a sequence that crosses keeps its short-factor keys).
    """
    t = torch.arange(max_positions, dtype=torch.float32, device=device)
    if config.rope_type != "longrope":
        return torch.outer(t, rope_inv_freq(config).to(device)), 1.0
    scaling = config.rope_scaling or {}
    original = int(scaling["original_max_position_embeddings"])
    base = _wavelength_base(config)
    short = (1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * base)).to(device)
    long = (1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * base)).to(device)
    angles = torch.cat([torch.outer(t[:original], short), torch.outer(t[original:], long)])
    factor = float(scaling.get("factor") or config.max_position_embeddings / original)
    magnitude = scaling.get("attention_factor")
    if magnitude is None:
        magnitude = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return angles, float(magnitude)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, with `linear` or `llama3` scaling
    (LongRoPE's depend on the position: `rope_angles`)."""
    inv_freq = 1.0 / _wavelength_base(config)
    scaling = config.rope_scaling
    kind = config.rope_type
    if scaling is None or kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        # Long wavelengths are slowed down by `factor`, short ones kept, the band in
        # between interpolated smoothly (Llama 3.1's context extension).
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    raise ValueError(f"rope_type {kind!r} has no position-independent frequencies")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once at load time.

    Tables are stored at full head width with the rotate-half sign folded into `sin`
    ([-sin, sin]), so applying RoPE is `x * cos + roll(x, half) * sin`: three ops.
    """

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        super().__init__()
        freqs, magnitude = rope_angles(config, max_positions, device)  # [positions, dim / 2]
        cos, sin = freqs.cos(), freqs.sin()
        if magnitude != 1.0:
            cos, sin = cos * magnitude, sin * magnitude
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(cos, signed sin), each [num_tokens, 1, head_dim]: once per step, for all layers."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] (HF's rotate-half layout) in place."""
    half = x.shape[-1] // 2
    # roll(x, half) = [x2, x1]; with sin = [-sin, sin]: [x1 cos - x2 sin, x2 cos + x1 sin].
    # Both addcmul inputs are temporaries, so writing the result over x is safe.
    return torch.addcmul(x * cos, x.roll(half, dims=-1), sin, out=x)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one projection."""

    def __init__(self, gate_up: nn.Module, down: nn.Module, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = gate_up
        self.down_proj = down
        self.intermediate_size = intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))
