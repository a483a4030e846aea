"""`ModelConfig`: the fields of an HF `config.json` our model implementations need."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Rope variants `layers.py` implements; anything else is refused when the config is read.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# Older Phi-3 configs call LongRoPE "su".
_ROPE_TYPE_ALIASES = {"su": "longrope"}
# Architectures whose q and k pass an RMSNorm before RoPE: per head (Qwen3) or over the
# whole projection, all heads together (OLMoE).
_QK_NORM = {
    "Qwen3ForCausalLM": "head",
    "Qwen3MoeForCausalLM": "head",
    "OlmoeForCausalLM": "full",
    "Gemma3ForCausalLM": "head",
}
# Mixture-of-experts architectures -> whether the top-k routing weights are renormalized
# to sum to 1 regardless of `norm_topk_prob` (Mixtral always does; the others ask the config).
_MOE_ALWAYS_NORMALIZED = {
    "MixtralForCausalLM": True,
    "Qwen2MoeForCausalLM": False,
    "Qwen3MoeForCausalLM": False,
    "OlmoeForCausalLM": False,
}
_ALWAYS_QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")


class ModelConfigError(ValueError):
    """config.json is missing, malformed or inconsistent; the message names file and field."""


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts part of a config: which layers route, and how.

    A routed layer sends each token to the `top_k` of `num_experts` gated MLPs (width
    `intermediate_size`) with the highest softmax router probability, weighted by those
    probabilities, renormalized over the k when `normalize_top_k`. `shared_intermediate_size`
    > 0 adds an always-on expert gated by sigmoid(x w) (Qwen2-MoE). `local_experts` is the
    range [start, end) of experts a model instance holds and runs (an expert-parallel rank's
    share, `tensor_parallel.ShardSpec`); None: all of them.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    sparse_layers: tuple[int, ...]  # the routed layers; the others have the dense MLP
    shared_intermediate_size: int = 0
    local_experts: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelConfigError(
                f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.top_k}"
            )
        if self.intermediate_size < 1:
            raise ModelConfigError(
                f"moe_intermediate_size must be positive, got {self.intermediate_size}"
            )
        if self.local_experts is not None:
            start, end = self.local_experts
            if not 0 <= start < end <= self.num_experts:
                raise ModelConfigError(
                    f"local experts [{start}, {end}) outside the {self.num_experts} experts"
                )


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
    # Tokens a query sees, its own included (Mistral v0.1, Phi-3, Qwen2 with
    # use_sliding_window, Gemma's local layers), in the layers `layer_window` says; None: all.
    sliding_window: int | None = None
    # "head": q/k RMSNorm per head (Qwen3); "full": over all heads at once (OLMoE).
    qk_norm_scope: str = "head"
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip, clip] after the norms
    moe: MoEConfig | None = None  # None: a dense model
    # Gemma 2: the MLP's activation, the attention scale's denominator (scale =
    # query_pre_attn_scalar^-0.5 instead of head_dim^-0.5), tanh soft-capping of the
    # attention scores and of the final logits (None: not capped)
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # per layer "sliding_attention" or "full_attention" where the config lists them or its
    # family implies them (Gemma 2 and 3, Qwen2/3's max_window_layers); None: all alike
    layer_types: tuple[str, ...] | None = None
    # Gemma 3: the sliding layers' RoPE base (unscaled); None: all layers rotate alike
    local_rope_theta: float | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ModelConfigError(
                f"layer_types lists {len(self.layer_types)} layers, the model has {self.num_layers}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None and self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"rope_type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.rope_type == "longrope":
            _check_longrope(self.rope_scaling or {}, self.head_dim)

    @property
    def rope_type(self) -> str:
        if self.rope_scaling is None:
            return "default"
        kind = self.rope_scaling.get("rope_type") or self.rope_scaling.get("type") or "default"
        return _ROPE_TYPE_ALIASES.get(kind, kind)

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

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer `index` (None: it attends to every position)."""
        if self.layer_types is not None and self.layer_types[index] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The window of every layer when all are windowed alike (Mistral v0.1): a block
        wholly before it is read by no later query, in any layer. None when some layer
        attends to everything (Gemma's global layers need every block)."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

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
        local_theta = raw.get("rope_local_base_freq")
        if "full_attention" in rope:  # Gemma 3: one rope per layer type
            local_theta = (rope.get("sliding_attention") or {}).get("rope_theta", local_theta)
            rope = rope["full_attention"] or {}
        scaling = raw.get("rope_scaling") or None
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            scaling = dict(rope)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (
            None,
            "default",
        ):
            scaling = None
        if scaling is not None:
            scaling = dict(scaling)  # filled in below; the caller's dict stays as it was
        if scaling is not None and "original_max_position_embeddings" in raw:
            # Phi-3 keeps LongRoPE's pretraining length beside `max_position_embeddings`;
            # as in transformers, that field wins over one inside the scaling dict
            scaling["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        # Only whole-head RoPE is implemented (Phi-4-mini rotates 3/4 of each head)
        partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if float(partial or 1.0) != 1.0:
            raise ModelConfigError(
                f"{origin}: partial_rotary_factor {partial} is not supported (only 1.0)"
            )
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
                # Qwen2 always has q/k/v biases and its config does not say so; Qwen2-MoE
                # says so as `qkv_bias` (transformers 5) or not at all.
                qkv_bias=bool(
                    raw.get(
                        "attention_bias",
                        raw.get("qkv_bias", architecture in _ALWAYS_QKV_BIAS),
                    )
                ),
                qk_norm=architecture in _QK_NORM,
                checkpoint_dtype=_DTYPES.get(str(dtype_name).removeprefix("torch."), torch.float32),
                eos_token_ids=eos_ids,
                quantization_config=raw.get("quantization_config"),
                sliding_window=window,
                qk_norm_scope=_QK_NORM.get(architecture, "head"),
                clip_qkv=raw.get("clip_qkv"),
                moe=_moe_config(raw, architecture, need),
                hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
                query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
                attn_logit_softcapping=raw.get("attn_logit_softcapping"),
                final_logit_softcapping=raw.get("final_logit_softcapping"),
                layer_types=_layer_types(raw, architecture),
                local_rope_theta=float(local_theta) if local_theta is not None else None,
            )
        except ModelConfigError as exc:
            raise ModelConfigError(f"{origin}: {exc}") from exc


def _layer_types(raw: dict[str, Any], architecture: str) -> tuple[str, ...] | None:
    """`layer_types`, or what a config without them implies, spelled out: Qwen2/3's
    `max_window_layers` (with `use_sliding_window`), Gemma 2's alternation, Gemma 3's older
    `sliding_window_pattern` (every n-th layer global, 6 by default)."""
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    num_layers = raw["num_hidden_layers"]
    if raw.get("use_sliding_window") and raw.get("max_window_layers") is not None:
        # Qwen2/3 as transformers reads them: the first max_window_layers layers see all
        first_windowed = raw["max_window_layers"]
        return tuple(
            "sliding_attention" if i >= first_windowed else "full_attention"
            for i in range(num_layers)
        )
    if architecture == "Gemma2ForCausalLM":  # transformers' default: the even layers slide
        return tuple(
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        )
    if architecture != "Gemma3ForCausalLM":
        return None
    pattern = raw.get("sliding_window_pattern") or 6
    return tuple(
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(raw["num_hidden_layers"])
    )


def _check_longrope(scaling: dict[str, Any], head_dim: int) -> None:
    """LongRoPE needs one short and one long factor per rotated frequency and the
    pretraining length at which the long ones take over."""
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != head_dim // 2:
            raise ModelConfigError(
                f"rope_scaling.{key} must list head_dim / 2 = {head_dim // 2} numbers, "
                f"got {factors!r:.60}"
            )
    if not scaling.get("original_max_position_embeddings"):
        raise ModelConfigError("longrope needs 'original_max_position_embeddings'")


def _moe_config(raw: dict[str, Any], architecture: str, need: Any) -> MoEConfig | None:
    if architecture not in _MOE_ALWAYS_NORMALIZED:
        return None
    # Mixtral names the count `num_local_experts`; transformers 5 writes Qwen3-MoE's so too.
    num_experts = raw.get("num_experts") or raw.get("num_local_experts")
    if not num_experts:
        raise ModelConfigError("missing field 'num_experts' (or 'num_local_experts')")
    num_layers = need("num_hidden_layers")
    # Qwen2/3-MoE may keep some layers dense: `mlp_only_layers`, or only every
    # `decoder_sparse_step`-th layer routed.
    dense = set(raw.get("mlp_only_layers") or ())
    step = raw.get("decoder_sparse_step") or 1
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return MoEConfig(
        num_experts=num_experts,
        top_k=need("num_experts_per_tok"),
        # Mixtral and OLMoE experts have the model's `intermediate_size`.
        intermediate_size=raw.get("moe_intermediate_size") or need("intermediate_size"),
        normalize_top_k=_MOE_ALWAYS_NORMALIZED[architecture] or bool(raw.get("norm_topk_prob")),
        sparse_layers=sparse,
        shared_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
    )
