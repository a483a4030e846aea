"""compressed-tensors `pack-quantized` W4A16 checkpoints (llm-compressor's GPTQ and AWQ).

Checkpoint layout per quantized linear (out features N, in features K, group size G):
`weight_packed` int32 [N, K/8] (eight 4-bit values per int32, element i at bits 4*(i%8),
stored as q + 8), `weight_scale` [N, K/G], `weight_shape` [2] = (N, K), and for
asymmetric schemes `weight_zero_point` int32 [N/8, K/G] packed the same way along N.
Dequantized: W = (q - zp) * scale, with q and zp in [-8, 7]. GPTQ's `actorder: weight`
stores columns in their original order (nothing to undo); `actorder: group` (a
`weight_g_idx` per column, dropped by llm-compressor) is refused.

Which linears are quantized, and how, comes from `config_groups` (`targets`: a class name
such as `Linear`, `re:<regex>` or a module name) minus `ignore`. With bf16 compute the
weights stay 4-bit: on CPU in modelship's W4A8 kernel (`int4.W4A8Linear`, AVX2) or torch's
int4 kernel (`int4.Int4Linear`), on a CUDA GPU (sm80+) in torch's tinygemm kernel
(`int4.CudaInt4Linear`). Elsewhere (fp32 or fp16 compute, older GPUs, shapes the kernels do
not take) they are dequantized once at load time into a dense weight: always correct, not
smaller in memory. `pack_linear` writes one linear's tensors in this layout (tests,
benchmarks).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelship.model.quant.base import DenseLinear, TensorSource, bf16_upcast_rows, load_bias
from modelship.model.quant.int4 import (
    CudaInt4Linear,
    create_int4_linear,
    cuda_kernel_available,
    cuda_kernel_supports,
    dequantize,
    pack_int4,
    unpack_int4,
)

logger = logging.getLogger(__name__)

_LINEAR_CLASSES = ("Linear", "torch.nn.Linear", "nn.Linear")


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weight arguments, as far as loading needs them."""

    targets: tuple[str, ...]
    group_size: int
    symmetric: bool


@dataclass
class _Part:
    """One projection's weight as read from the checkpoint."""

    dense: torch.Tensor | None = None  # [out, in], an unquantized projection
    u: torch.Tensor | None = None  # [out, in] int32 in [0, 15]
    scale: torch.Tensor | None = None  # [out, in / group_size]
    zero_point: torch.Tensor | None = None  # [out, in / group_size] signed
    scheme: WeightScheme | None = None


class CompressedTensorsW4A16:
    """Loads `quant_method: compressed-tensors`, `format: pack-quantized`, 4-bit group-wise."""

    name = "compressed-tensors"

    def __init__(self, config: dict[str, Any], int4_kernel: str = "auto") -> None:
        self.int4_kernel = int4_kernel
        default_format = config.get("format")
        if config.get("sparsity_config") or config.get("transform_config"):
            raise ValueError("sparsity and transform configs are not supported")
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"quantization_status {status!r}: expected 'compressed'")
        self.schemes: list[WeightScheme] = []
        for name, group in (config.get("config_groups") or {}).items():
            self.schemes.append(_parse_group(name, group, default_format))
        if not self.schemes:
            raise ValueError("quantization_config has no config_groups")
        self.ignore = tuple(config.get("ignore") or ())
        self._logged: set[str] = set()  # CUDA fallback reasons already logged

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme quantizing module `module` (HF name, e.g. `...self_attn.q_proj`)."""
        if any(_matches(module, pattern) for pattern in self.ignore):
            return None
        for scheme in self.schemes:
            if any(_matches(module, target) for target in scheme.targets):
                return scheme
        return None

    def load_linear(
        self,
        get: TensorSource,
        prefixes: list[str],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module:
        device = torch.device(device)
        parts = [self._read(get, p) for p in prefixes]
        b = load_bias(get, prefixes, dtype, device) if bias else None
        quantized = [p for p in parts if p.scheme is not None]
        group_sizes = {p.scheme.group_size for p in quantized if p.scheme is not None}
        one_scheme = len(quantized) == len(parts) and len(group_sizes) == 1
        if one_scheme and dtype == torch.bfloat16:
            linear = self._int4_linear(prefixes[0], parts, group_sizes.pop(), b, device)
            if linear is not None:
                return linear
        elif quantized and device.type == "cuda":
            self._log_once(
                f"{dtype} compute (the CUDA int4 kernel is bf16 only)"
                if one_scheme
                else "projections fused across quantization schemes"
            )
        weight = torch.cat([_dense_weight(p).to(dtype=dtype, device=device) for p in parts])
        return DenseLinear(weight, b, bf16_upcast_rows(device, dtype))

    def _int4_linear(
        self,
        prefix: str,
        parts: list[_Part],
        group_size: int,
        b: torch.Tensor | None,
        device: torch.device,
    ) -> nn.Module | None:
        """The int4-kernel linear for `device` (bf16 compute), or None (dequantize)."""
        u = torch.cat([p.u for p in parts])  # type: ignore[misc]
        scale = torch.cat([p.scale for p in parts])  # type: ignore[misc]
        zero_point = torch.cat([p.zero_point for p in parts])  # type: ignore[misc]
        out_features, in_features = u.shape
        if device.type == "cpu":
            linear = create_int4_linear(u, scale, zero_point, group_size, b, self.int4_kernel)
            if linear is None:
                logger.info("%s: shape not taken by the int4 kernel; dequantized", prefix)
            return linear
        if device.type != "cuda":
            return None
        if not cuda_kernel_available(device):
            self._log_once(f"{device} has no bf16 tensor cores (the CUDA int4 kernel needs sm80+)")
            return None
        if not cuda_kernel_supports(out_features, in_features, group_size):
            self._log_once(
                f"a {out_features}x{in_features} projection with group size {group_size} "
                "(the CUDA int4 kernel takes out % 8 == 0, in % 32 == 0, group 32-256)"
            )
            return None
        return CudaInt4Linear.from_unpacked(u, scale, zero_point, group_size, b, device)

    def _log_once(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("int4 weights dequantized to dense on CUDA: %s", reason)

    def _read(self, get: TensorSource, prefix: str) -> _Part:
        scheme = self.scheme_for(prefix)
        if scheme is None:
            dense = get(f"{prefix}.weight")
            return _Part(dense=dense)
        out_features, in_features = (int(v) for v in get(f"{prefix}.weight_shape").tolist())
        u = unpack_int4(get(f"{prefix}.weight_packed"), in_features)
        if u.shape != (out_features, in_features):
            raise ValueError(f"{prefix}.weight_packed does not hold a {out_features}x{in_features}")
        num_groups = -(-in_features // scheme.group_size)
        scale = get(f"{prefix}.weight_scale")
        if tuple(scale.shape) != (out_features, num_groups):
            raise ValueError(
                f"{prefix}.weight_scale has shape {tuple(scale.shape)}, expected "
                f"({out_features}, {num_groups}) for group_size {scheme.group_size}"
            )
        if scheme.symmetric:
            zero_point = torch.zeros(out_features, num_groups, dtype=torch.int32)
        else:
            zero_point = _unpack_zero_point(get(f"{prefix}.weight_zero_point"), out_features)
        return _Part(None, u, scale, zero_point, scheme)


def _parse_group(name: str, group: dict[str, Any], default_format: str | None) -> WeightScheme:
    group_format = group.get("format") or default_format
    if group_format != "pack-quantized":
        raise ValueError(f"config group {name!r}: format {group_format!r} (need pack-quantized)")
    if group.get("input_activations") or group.get("output_activations"):
        raise ValueError(f"config group {name!r}: activation quantization is not supported")
    weights = group.get("weights") or {}
    num_bits, strategy = weights.get("num_bits"), weights.get("strategy")
    if num_bits != 4 or weights.get("type", "int") != "int" or strategy != "group":
        raise ValueError(
            f"config group {name!r}: only 4-bit int group-wise weights (W4A16) are supported, "
            f"got num_bits={num_bits} type={weights.get('type')} strategy={strategy}"
        )
    group_size = weights.get("group_size")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"config group {name!r}: bad group_size {group_size!r}")
    if weights.get("actorder") == "group":
        raise ValueError(f"config group {name!r}: actorder 'group' (weight_g_idx) is not supported")
    return WeightScheme(
        targets=tuple(group.get("targets") or ()),
        group_size=group_size,
        symmetric=bool(weights.get("symmetric", True)),
    )


def _matches(module: str, pattern: str) -> bool:
    """compressed-tensors target matching, for the linears of our models."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if pattern in _LINEAR_CLASSES:
        return True  # every projection we load is a Linear
    return module == pattern or module.endswith(f".{pattern}")


def _unpack_zero_point(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """[ceil(out/8), groups] int32 packed along the output dim -> [out, groups] signed."""
    if packed.dtype != torch.int32:  # stored unpacked (int8), already signed
        return packed.to(torch.int32)
    return unpack_int4(packed.t().contiguous(), out_features).t() - 8


def _dense_weight(part: _Part) -> torch.Tensor:  # [out, in]
    if part.dense is not None:
        return part.dense
    assert part.u is not None and part.scale is not None and part.zero_point is not None
    assert part.scheme is not None
    group_size = part.scheme.group_size
    if part.u.shape[1] % group_size == 0:
        return dequantize(part.u, part.scale, part.zero_point, group_size)
    # A ragged last group: look each column's group up explicitly.
    groups = torch.arange(part.u.shape[1]) // group_size
    scale = part.scale.float()[:, groups]
    return (part.u.float() - 8 - part.zero_point.float()[:, groups]) * scale


def pack_linear(
    u: torch.Tensor,  # [out, in] int32 in [0, 15]
    scale: torch.Tensor,  # [out, in / group_size], stored as given
    zero_point: torch.Tensor | None,  # [out, in / group_size] signed; None: symmetric
) -> dict[str, torch.Tensor]:
    """One quantized linear as llm-compressor's `pack-quantized` stores it, keyed by the
    suffix after the module name (`weight_packed`, ...): what `load_linear` reads back."""
    out_features, in_features = u.shape
    tensors = {
        "weight_packed": pack_int4(u),
        "weight_scale": scale.contiguous(),
        "weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64),
    }
    if zero_point is not None:  # [ceil(out / 8), groups], packed along the output dim
        tensors["weight_zero_point"] = pack_int4((zero_point + 8).t()).t().contiguous()
    return tensors
