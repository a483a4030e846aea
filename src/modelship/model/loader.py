"""Load an HF safetensors folder into one of our model implementations."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from modelship.model.config import ModelConfig
from modelship.model.quant import create_quantization
from modelship.model.registry import CausalLM, create_model


class MissingWeightError(KeyError):
    """A tensor the model needs is not in the checkpoint; the message names it."""

    def __str__(self) -> str:
        return str(self.args[0])


class _Checkpoint:
    """Name -> tensor over all safetensors files of a folder (sharded or not), lazily."""

    def __init__(self, model_dir: Path, stack: ExitStack, device: str) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
        self.model_dir = model_dir
        self.location: dict[str, object] = {}
        for file in files:
            handle = stack.enter_context(safe_open(file, framework="pt", device=device))
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self.location[name] = handle
        self.used: set[str] = set()

    def get(self, name: str) -> torch.Tensor:
        handle = self.location.get(name)
        if handle is None:
            raise MissingWeightError(f"{self.model_dir}: checkpoint has no tensor {name!r}")
        self.used.add(name)
        return handle.get_tensor(name)


def resolve_dtype(config: ModelConfig, device: torch.device, dtype: torch.dtype | None):
    """bf16 on CPU by default (fp16 checkpoints too), the checkpoint's dtype elsewhere."""
    if dtype is not None:
        return dtype
    if device.type == "cpu":
        return torch.bfloat16
    return config.checkpoint_dtype if config.checkpoint_dtype != torch.float32 else torch.float16


def load_model(
    model_dir: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    max_positions: int | None = None,
) -> CausalLM:
    """Build the model for `model_dir/config.json` and fill it from its safetensors."""
    model_dir = Path(model_dir)
    device = torch.device(device)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    config = ModelConfig.from_dir(model_dir)
    dtype = resolve_dtype(config, device, dtype)
    quantization = create_quantization(config.quantization_config)
    with ExitStack() as stack, torch.no_grad():
        checkpoint = _Checkpoint(model_dir, stack, "cpu")

        def linear(prefixes: list[str], bias: bool) -> torch.nn.Module:
            return quantization.load_linear(checkpoint.get, prefixes, bias, dtype, device)

        model = create_model(
            config, linear, max_positions or config.max_position_embeddings, device
        )
        # Everything still on the meta device (embeddings, norms) is a plain tensor to assign.
        state = {}
        for name, param in model.named_parameters():
            if param.is_meta:
                state[name] = checkpoint.get(_checkpoint_name(name)).to(dtype=dtype, device=device)
        model.load_state_dict(state, strict=False, assign=True)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise MissingWeightError(f"{model_dir}: weights not loaded: {', '.join(leftover[:5])}")
    model.requires_grad_(False)
    model.eval()
    return model


def _checkpoint_name(name: str) -> str:
    # Our module tree flattens HF's `model.` level for the embeddings and final norm.
    if name.startswith(("embed_tokens.", "norm.")):
        return f"model.{name}"
    if name.startswith("layers."):
        return f"model.{name}"
    return name


def read_generation_eos(model_dir: Path) -> set[int]:
    """EOS ids from generation_config.json (often more complete than config.json's)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}
