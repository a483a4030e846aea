"""`ModelConfig`: the fields of an HF `config.json` our model implementations need."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelConfigError(ValueError):
    """config.json is missing or lacks a field; the message names the file and field."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    checkpoint_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    quantization_config: dict[str, Any] | None

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ModelConfigError(f"{path}: not found") from exc
        except ValueError as exc:
            raise ModelConfigError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, origin=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], origin: str = "config.json") -> ModelConfig:
        def need(key: str) -> Any:
            if key not in raw:
                raise ModelConfigError(f"{origin}: missing field {key!r}")
            return raw[key]

        architectures = need("architectures")
        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        # transformers 5 moves rope settings under `rope_parameters`; older files use
        # `rope_theta` + `rope_scaling`.
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or None
        if rope.get("rope_type", "default") not in ("default", None):
            scaling = dict(rope)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (
            None,
            "default",
        ):
            scaling = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        architecture = architectures[0]
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            vocab_size=need("vocab_size"),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(raw.get("attention_bias")),
            qk_norm=architecture == "Qwen3ForCausalLM",
            checkpoint_dtype=_DTYPES.get(str(dtype_name), torch.float32),
            eos_token_ids=eos_ids,
            quantization_config=raw.get("quantization_config"),
        )
