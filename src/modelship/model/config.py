"""`ModelConfig`: the fields of an HF `config.json` our model implementations need."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Rope variants `rope.py` implements; anything else is refused when the config is read.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """config.json is missing, malformed or inconsistent; the message names file and field."""


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only checkpoint's shape and numerics, read from its `config.json`.

    `rope_scaling` is None for plain RoPE, else the HF dict with at least `rope_type`
    (e.g. `llama3` with `factor`, `low_freq_factor`, `high_freq_factor`,
    `original_max_position_embeddings`). `checkpoint_dtype` is the dtype the weights were
    saved in (not necessarily the compute dtype). `quantization_config` is the raw dict
    from `config.json`, or None for a dense checkpoint.
    """

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
    # Tokens a query may look back (Mistral v0.1; Qwen2 with use_sliding_window); None: all.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None and self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"rope_type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def rope_type(self) -> str:
        if self.rope_scaling is None:
            return "default"
        return self.rope_scaling.get("rope_type") or self.rope_scaling.get("type") or "default"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> ModelConfig:
        """Read `<model_dir>/config.json`; raises `ModelConfigError` naming the file."""
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
        """Build from a parsed `config.json`; `origin` names the file in error messages."""

        def need(key: str) -> Any:
            if key not in raw:
                raise ModelConfigError(f"{origin}: missing field {key!r}")
            return raw[key]

        architectures = need("architectures")
        if not architectures:
            raise ModelConfigError(f"{origin}: field 'architectures' is empty")
        architecture = architectures[0]
        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        # transformers 5 moves rope settings under `rope_parameters` (theta included);
        # older files have `rope_theta` + `rope_scaling`.
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or None
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            scaling = dict(rope)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (
            None,
            "default",
        ):
            scaling = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        window = raw.get("sliding_window")
        if "use_sliding_window" in raw and not raw["use_sliding_window"]:
            window = None  # Qwen2 configs name a window they do not use
        try:
            return cls(
                architecture=architecture,
                hidden_size=hidden,
                intermediate_size=need("intermediate_size"),
                num_layers=need("num_hidden_layers"),
                num_heads=num_heads,
                num_kv_heads=raw.get("num_key_value_heads") or num_heads,
                head_dim=raw.get("head_dim") or hidden // num_heads,
                vocab_size=need("vocab_size"),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                max_position_embeddings=raw.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases and its config does not say so.
                qkv_bias=bool(raw.get("attention_bias", architecture == "Qwen2ForCausalLM")),
                qk_norm=architecture == "Qwen3ForCausalLM",
                checkpoint_dtype=_DTYPES.get(str(dtype_name).removeprefix("torch."), torch.float32),
                eos_token_ids=eos_ids,
                quantization_config=raw.get("quantization_config"),
                sliding_window=window,
            )
        except ModelConfigError as exc:
            raise ModelConfigError(f"{origin}: {exc}") from exc
