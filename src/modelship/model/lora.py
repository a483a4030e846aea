"""LoRA adapters (PEFT format) applied on top of any base projection, several per step.

An adapter is a folder with `adapter_config.json` and `adapter_model.safetensors` (keys
like `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`). Its delta on a
projection is `scale * (x @ A^T) @ B^T`, added to whatever the base computed (dense, int8
or int4): the base weights are never touched, so one model serves many adapters at once.

The fused projections (qkv, gate_up) keep the adapter's per-target A/B; each target's
delta goes into its slice of the fused output. Applying: `attach_lora` puts one forward
hook on each projection of each layer; the hooks read the step's `LoRAContext` (set by the
runner): a list of (adapter, row indices) segments. A step with no adapter rows leaves the
context empty and every hook returns at once. The delta is a segment loop: per adapter
present in the batch, its rows are gathered, multiplied by A then B (two small matmuls)
into their slices of one contiguous delta, added into the output rows with one
`index_add_` per adapter; a stacked [slots, r, in] bmm would multiply
a per-row copy of A and B. The number of adapters in a step is small (`max_loras`).
The CPU fused decoder runs all layers in one C++ call and calls no hooks: steps with
adapter rows take the per-layer Python path (`LlamaForCausalLM.forward`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

# PEFT target module -> (our fused projection attribute path, index of its slice)
_TARGETS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_PREFIX = "base_model.model."


class LoRAError(ValueError):
    """An adapter folder this server cannot serve; the message names the field or file."""


@dataclass
class LoRAAdapter:
    """One adapter's weights on the model's device and dtype. `key` (name + content hash)
    namespaces the prefix cache: a changed adapter reloaded under a name never hits blocks
    cached under the old one."""

    name: str
    path: Path
    rank: int
    scale: float
    key: str
    # (layer index, projection attribute path) -> [(slice index, A [r, in], B [out, r])]
    weights: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def load(
        cls, name: str, path: str | Path, num_layers: int, dtype: torch.dtype, device: torch.device
    ) -> LoRAAdapter:
        from safetensors.torch import load_file

        path = Path(path)
        config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
        for file in (config_file, weights_file):
            if not file.is_file():
                raise LoRAError(f"LoRA adapter {name!r}: {file} does not exist")
        raw = config_file.read_bytes()
        try:
            config = json.loads(raw)
        except ValueError as exc:
            raise LoRAError(f"LoRA adapter {name!r}: {config_file} is not JSON: {exc}") from exc
        if not isinstance(config, dict):
            raise LoRAError(f"LoRA adapter {name!r}: {config_file} is not a JSON object")
        _check_config(name, config)
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        blob = weights_file.read_bytes()
        digest = hashlib.sha256(raw + b"\0" + blob).hexdigest()[:32]
        key = f"{name}:{digest}"
        try:
            tensors = load_file(str(weights_file))
        except Exception as exc:  # safetensors raises its own errors for a damaged file
            raise LoRAError(
                f"LoRA adapter {name!r}: {weights_file} is not a readable safetensors file ({exc})"
            ) from exc
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for tensor_key, tensor in tensors.items():
            parts = tensor_key.removeprefix(_PREFIX).split(".")
            # model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight
            if (
                len(parts) != 7
                or parts[:2] != ["model", "layers"]
                or parts[4] not in _TARGETS
                or parts[5] not in ("lora_A", "lora_B")
                or parts[6] != "weight"
            ):
                raise LoRAError(
                    f"LoRA adapter {name!r}: tensor {tensor_key!r} is not a supported LoRA "
                    f"weight (supported: lora_A/lora_B of {', '.join(_TARGETS)} in the layers)"
                )
            layer = int(parts[2])
            if not 0 <= layer < num_layers:
                raise LoRAError(f"LoRA adapter {name!r}: layer {layer} is not in the model")
            pairs.setdefault((layer, parts[4]), {})[parts[5]] = tensor
        adapter = cls(name, path, rank, scale, key)
        for (layer, target), pair in sorted(pairs.items()):
            if set(pair) != {"lora_A", "lora_B"}:
                raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {target} lacks A or B")
            a, b = pair["lora_A"], pair["lora_B"]
            if a.shape[0] != b.shape[1]:
                raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {target} A/B ranks differ")
            projection, index = _TARGETS[target]
            a = a.to(device=device, dtype=dtype).contiguous()
            # the scale folded into B: one multiply less per step
            b = (b.float() * scale).to(device=device, dtype=dtype).contiguous()
            adapter.weights.setdefault((layer, projection), []).append((index, a, b))
        return adapter


def _check_config(name: str, config: dict) -> None:
    """Refuse, naming the field, what the delta `scale * B A x` does not cover."""

    def refuse(field_name: str, why: str) -> None:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json {field_name!r} {why}")

    if config.get("peft_type", "LORA") != "LORA":
        refuse("peft_type", f"is {config['peft_type']!r}; only LORA is supported")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        refuse("r", "must be a positive integer")
    if config.get("use_dora"):
        refuse("use_dora", "is set; DoRA is not supported")
    if config.get("modules_to_save"):
        refuse("modules_to_save", "is set; fully trained modules are not supported")
    if config.get("bias", "none") != "none":
        refuse("bias", "must be 'none'; trained biases are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            refuse(key, "is set; per-module ranks/alphas are not supported")
    if config.get("layer_replication"):
        refuse("layer_replication", "is set; it is not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):  # a regex in PEFT; the tensor names are checked anyway
        return
    unsupported = sorted(set(targets) - set(_TARGETS))
    if unsupported:
        refuse("target_modules", f"names {unsupported}; supported: {sorted(_TARGETS)}")


@dataclass
class LoRAContext:
    """The current step's adapter rows: (adapter, row indices [n] int64) per adapter present.
    Empty for a step without adapter rows."""

    segments: list[tuple[LoRAAdapter, torch.Tensor]] = field(default_factory=list)


def _resolve(layer: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        layer = getattr(layer, part)
    return layer


def attach_lora(layers: nn.ModuleList, slices: dict[str, list[int]]) -> LoRAContext:
    """Hook every LoRA-able projection of `layers`; `slices` gives each fused projection's
    output widths in target order (qkv: q, k, v). Returns the context the hooks read."""
    context = LoRAContext()
    for layer_index, layer in enumerate(layers):
        for projection in ("qkv_proj", "o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            widths = slices[projection]
            offsets = [sum(widths[:i]) for i in range(len(widths) + 1)]
            hook = _make_hook(context, (layer_index, projection), offsets)
            _resolve(layer, projection).register_forward_hook(hook)
    return context


def _make_hook(context: LoRAContext, where: tuple[int, str], offsets: list[int]):
    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor):
        if not context.segments:
            return None
        x = inputs[0]
        for adapter, rows in context.segments:
            targets = adapter.weights.get(where)
            if not targets:
                continue
            xa = x.index_select(0, rows)  # [n, in]
            # Each target's delta into its slice of one contiguous [n, out] buffer, added
            # with one index_add_: into a column slice of `out` (not contiguous) a bf16
            # index_add_ takes ~0.8 ms on CPU, 25x the contiguous one.
            delta = out.new_zeros(len(rows), out.shape[1])
            for index, a, b in targets:
                delta[:, offsets[index] : offsets[index + 1]] = (xa @ a.t()) @ b.t()
            out.index_add_(0, rows, delta)
        return out

    return hook
