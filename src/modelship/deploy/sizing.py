"""What one serving replica needs, from the model's architecture: weight bytes, KV-cache
bytes, host memory and the number of GPUs.

Read from the base checkpoint's `config.json` (the source folder, or the base already in the
config's storage); render uses it to raise the engine pods' memory and GPU count to what the
model needs (`RenderContext.serving`). Nothing is loaded: parameters are counted from the
shapes.

- Weights: the largest of the configured variants, since select may publish any of them.
  Dense variants hold every parameter at their dtype's width; int4 variants (gptq, awq)
  hold the decoder layers' projections (experts included) at `bits` bits plus one 16-bit
  scale per group of `group_size` inputs (and for asymmetric schemes a `bits`-bit zero
  point), and keep the embeddings, the head, norms and routers at 16 bits.
- KV cache: keys and values of every layer, `2 x kv_heads x head_dim` elements per token,
  but a sliding-window layer holds at most its window, whatever the context. The engine's
  budget (`serve.engine.kv_cache_memory_mb`) counts, raised to one sequence of
  `max_model_len` tokens (less and a full-length request cannot run at all); with
  `kv_cache_memory_fraction` the engine takes a share of what is free, so that one sequence
  is the need.
- Host memory: weights (loading reads the checkpoint through host memory) plus a runtime
  overhead, plus the KV cache on CPU. The limit leaves a quarter on top.
- GPUs: the fewest of 1, 2, 4, 8 (a divisor of the attention heads: tensor parallelism
  splits them) whose share of weights + KV cache, plus a CUDA context, fits
  `deploy.serving.gpu.memory` times `GPU_MEMORY_USABLE`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelship.config import ModelshipConfig
    from modelship.model.config import ModelConfig
    from modelship.pipeline.optimize.recipe import Recipe

GiB = 1024**3
# Python, torch, the tokenizer, activations and the server: measured RSS of a replica of a
# tiny model is ~0.6 GiB; the rest is headroom for a step's activations.
HOST_OVERHEAD_BYTES = 1 * GiB
CUDA_CONTEXT_BYTES = 1 * GiB  # per GPU, beside weights and KV cache
GPU_MEMORY_USABLE = 0.9  # fragmentation and the allocator's cache
LIMIT_FACTOR = 1.25
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2}


class SizingError(ValueError):
    """The model does not fit the configured GPUs; the message names the field to change."""


@dataclass(frozen=True)
class ParameterCount:
    quantizable: int  # the decoder layers' projections (attention, MLP, experts)
    other: int  # embeddings, head, norms, routers: kept at 16 bits by the int4 schemes

    @property
    def total(self) -> int:
        return self.quantizable + self.other


@dataclass(frozen=True)
class ServingSize:
    """One replica's needs, in bytes, and its GPU count (0 on CPU). A mixture-of-experts
    model on several GPUs shards its experts (`--expert-parallel`): our engine refuses to
    split one over tensor-parallel ranks otherwise."""

    weight_bytes: int
    kv_cache_bytes: int
    host_memory_bytes: int
    num_gpus: int
    mixture_of_experts: bool = False

    @property
    def host_memory_limit_bytes(self) -> int:
        return int(self.host_memory_bytes * LIMIT_FACTOR)


def count_parameters(model: ModelConfig) -> ParameterCount:
    hidden = model.hidden_size
    attention = hidden * (model.q_size + 2 * model.kv_size) + model.q_size * hidden
    dense_mlp = 3 * hidden * model.intermediate_size
    quantizable = other = 0
    moe = model.moe
    for layer in range(model.num_layers):
        quantizable += attention
        other += 2 * hidden  # two norms (Gemma's four are noise at this scale)
        if moe is None or layer not in moe.sparse_layers:
            quantizable += dense_mlp
            continue
        quantizable += moe.num_experts * 3 * hidden * moe.intermediate_size
        quantizable += 3 * hidden * moe.shared_intermediate_size
        other += moe.num_experts * hidden + (hidden if moe.shared_intermediate_size else 0)
    heads = 1 if model.tie_word_embeddings else 2
    other += heads * model.vocab_size * hidden + hidden
    return ParameterCount(quantizable, other)


def weight_bytes(model: ModelConfig, recipe: Recipe) -> int:
    """Bytes of a variant made with `recipe` (see the module docstring)."""
    params = count_parameters(model)
    width = _DTYPE_BYTES.get(recipe.dtype, 2)
    if not recipe.bits:
        return params.total * width
    per_group = 2 + (0 if recipe.symmetric else recipe.bits / 8)  # scale (+ zero point)
    per_weight = recipe.bits / 8 + per_group / (recipe.group_size or 128)
    return int(params.quantizable * per_weight) + params.other * 2


def kv_bytes_per_sequence(model: ModelConfig, num_tokens: int, kv_dtype: str) -> int:
    """Keys and values of one sequence of `num_tokens`: a sliding-window layer holds only
    its window. int8/fp8 caches hold one byte per element plus an fp32 scale per vector."""
    if kv_dtype in ("int8", "fp8", "fp8_e4m3"):
        per_vector = model.head_dim + 4
    else:
        per_vector = model.head_dim * _DTYPE_BYTES.get(kv_dtype, 2)
    tokens = sum(
        min(num_tokens, model.layer_window(i) or num_tokens) for i in range(model.num_layers)
    )
    return tokens * 2 * model.num_kv_heads * per_vector


def model_config_path(config: ModelshipConfig, slug: str) -> Path | None:
    """The base checkpoint's config.json where render can read it: the source folder, else
    the base already acquired into the config's storage; None when neither holds one."""
    source = Path(config.source).expanduser()
    for candidate in (source / "config.json", config.storage / "models" / slug / "base" /
                      "config.json"):  # fmt: skip
        if candidate.is_file():
            return candidate
    return None


def size_replica(config: ModelshipConfig, model: ModelConfig) -> ServingSize:
    """What one engine replica of `model` served as `config` says needs."""
    from modelship.deploy.quantity import parse_quantity
    from modelship.pipeline.optimize import recipe_for

    recipes = config.optimize.recipes
    weights = max(weight_bytes(model, recipe_for(v, recipes.get(v))) for v in
                  config.optimize.variants)  # fmt: skip
    engine = config.serve.engine
    gpu = config.deploy.serving.gpu
    on_gpu = gpu is not None and (config.deploy.serving.engine == "vllm" or
                                  engine.device != "cpu")  # fmt: skip
    compute = engine.dtype if engine.dtype in _DTYPE_BYTES else "bfloat16"
    kv_dtype = engine.kv_cache_dtype or (compute if on_gpu else "float32")
    max_len = engine.max_model_len or model.max_position_embeddings
    one_sequence = kv_bytes_per_sequence(model, max_len, kv_dtype)
    budget = 0 if engine.kv_cache_memory_fraction is not None else engine.kv_cache_memory_mb
    kv = max(budget * 1024**2, one_sequence)  # a fraction of free memory: at least one
    host = weights + HOST_OVERHEAD_BYTES + (0 if on_gpu else kv)
    moe = model.moe is not None
    if not on_gpu:
        return ServingSize(weights, kv, host, 0, moe)
    usable = float(parse_quantity(gpu.memory)) * GPU_MEMORY_USABLE
    for count in TENSOR_PARALLEL_SIZES:
        shards = model.num_heads % count == 0 and (not moe or model.moe.num_experts % count == 0)
        if shards and (weights + kv) / count + CUDA_CONTEXT_BYTES <= usable:
            return ServingSize(weights, kv, host, count, moe)
    raise SizingError(
        f"deploy.serving.gpu.memory: {gpu.memory} per GPU does not hold the model on up to "
        f"{TENSOR_PARALLEL_SIZES[-1]} GPUs ({_gib(weights)} of weights and {_gib(kv)} of KV "
        "cache); use larger GPUs, an int4 variant only, or a smaller kv_cache_memory_mb"
    )


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.1f} GiB"


def gib_quantity(num_bytes: int) -> str:
    """A Kubernetes quantity of at least `num_bytes`, in whole MiB."""
    return f"{math.ceil(num_bytes / 1024**2)}Mi"
