"""Load an HF safetensors folder into one of our model implementations."""

from __future__ import annotations

import json
import logging
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from modelship.model import cpu_kernels
from modelship.model.config import ModelConfig
from modelship.model.moe import moe_block
from modelship.model.quant import create_quantization
from modelship.model.quant.int4 import cuda_kernel_available
from modelship.model.quant.int8 import LM_HEADS
from modelship.model.registry import CausalLM, create_model
from modelship.model.tensor_parallel import ShardSpec, wrap_row_parallel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EXPERT_WEIGHT = re.compile(r"(?P<block>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight")
_EXPERT_MODULE = re.compile(r"(?P<expert>.+\.experts\.\d+)\.(?P<proj>\w+)")
# expert projection -> (stacked tensor, half of its rows or None)
_STACKED_PARTS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}
# Mixtral's original expert names (its Hub checkpoints; transformers 5 saves them back that
# way) for transformers 5's, which llm-compressor's int4 checkpoints keep.
_MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# Projections some checkpoints store fused (Phi-3): part -> the fused tensor's name.
_FUSED_PARTS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_PROJECTION = re.compile(r"(?P<module>.+)\.(?P<proj>\w+)\.(?P<kind>weight|bias)")


class MissingWeightError(KeyError):
    """A tensor the model needs is not in the checkpoint; the message names it."""

    def __str__(self) -> str:
        return str(self.args[0])


class _Checkpoint:
    """Name -> tensor over the safetensors files of a folder (sharded or not), lazily.

    With a `model.safetensors.index.json` only the files it names are read (some repos
    also ship a consolidated copy of the same weights under other names).
    """

    def __init__(self, model_dir: Path, stack: ExitStack, config: ModelConfig) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = [model_dir / name for name in sorted(set(weight_map.values()))]
        else:
            files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
        self.model_dir = model_dir
        self.config = config
        self.location: dict[str, Any] = {}
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: named in {index.name} but missing")
            handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self.location[name] = handle
        self.modules = {name.rpartition(".")[0] for name in self.location}
        self.used: set[str] = set()

    def module(self, name: str) -> str:
        """The checkpoint's name for module `name`: `name` itself, or for an expert
        projection the checkpoint has only under Mixtral's original spelling, that one
        (`...experts.3.gate_proj` -> `...experts.3.w1`). Quantization schemes then match
        their targets and ignore lists against the names the checkpoint was written with."""
        match = _EXPERT_MODULE.fullmatch(name)
        if name in self.modules or match is None or match["proj"] not in _MIXTRAL_EXPERT_NAMES:
            return name
        original = f"{match['expert']}.{_MIXTRAL_EXPERT_NAMES[match['proj']]}"
        return original if original in self.modules else name

    def get(self, name: str) -> torch.Tensor:
        handle = self.location.get(name)
        if handle is None:
            part = self._stacked_expert(name)
            if part is None:
                part = self._fused_part(name)
            if part is None:
                raise MissingWeightError(f"{self.model_dir}: checkpoint has no tensor {name!r}")
            return part
        self.used.add(name)
        return handle.get_tensor(name)

    def _fused_part(self, name: str) -> torch.Tensor | None:
        """One projection's rows of a fused `qkv_proj` (q, then k, then v: the config's
        head counts give the split) or `gate_up_proj` (gate rows first, then up) weight or
        bias; None when `name` is no such part or the fused tensor is absent too. Only the
        part's rows are read."""
        match = _PROJECTION.fullmatch(name)
        if match is None or match["proj"] not in _FUSED_PARTS:
            return None
        fused_name = f"{match['module']}.{_FUSED_PARTS[match['proj']]}.{match['kind']}"
        handle = self.location.get(fused_name)
        if handle is None:
            return None
        fused = handle.get_slice(fused_name)
        rows = fused.get_shape()[0]
        q, kv = self.config.q_size, self.config.kv_size
        bounds = {
            "q_proj": (0, q, q + 2 * kv),
            "k_proj": (q, q + kv, q + 2 * kv),
            "v_proj": (q + kv, q + 2 * kv, q + 2 * kv),
            "gate_proj": (0, rows // 2, rows - rows % 2),
            "up_proj": (rows // 2, rows, rows - rows % 2),
        }
        start, end, expected = bounds[match["proj"]]
        if rows != expected:
            raise MissingWeightError(
                f"{self.model_dir}: {fused_name} has {rows} rows; the config implies {expected}"
            )
        self.used.add(fused_name)
        return fused[start:end]

    def _stacked_expert(self, name: str) -> torch.Tensor | None:
        """One expert's projection out of the stacked layout transformers 5 keeps in memory
        (`<block>.experts.gate_up_proj` [E, 2 x I, hidden], gate rows first, and
        `<block>.experts.down_proj` [E, hidden, I]), for checkpoints written that way;
        None when `name` is no expert projection or the stack is absent too."""
        match = _EXPERT_WEIGHT.fullmatch(name)
        if match is None:
            return None
        stack, half = _STACKED_PARTS[match["proj"]]
        stacked_name = f"{match['block']}.{stack}"
        handle = self.location.get(stacked_name)
        if handle is None:
            return None
        self.used.add(stacked_name)
        expert = handle.get_slice(stacked_name)[int(match["expert"])]  # reads one expert
        if half is None:
            return expert
        rows = expert.shape[0] // 2
        return expert[half * rows : (half + 1) * rows]


def resolve_dtype(
    config: ModelConfig, device: torch.device, dtype: torch.dtype | str | None
) -> torch.dtype:
    """The compute dtype: as asked, else bf16 on CPU (fp16 checkpoints too: torch's CPU
    kernels are fast in bf16), else bf16 for int4 checkpoints on a GPU that runs the CUDA
    int4 kernel (bf16 only; the optimize stage saves them in fp16), else the checkpoint's
    half-precision dtype (fp16 for fp32)."""
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype.removeprefix("torch.")]
    if dtype is not None:
        return dtype
    if device.type == "cpu":
        return torch.bfloat16
    quant_method = (config.quantization_config or {}).get("quant_method")
    if quant_method == "compressed-tensors" and cuda_kernel_available(device):
        return torch.bfloat16
    return config.checkpoint_dtype if config.checkpoint_dtype != torch.float32 else torch.float16


def load_model(
    model_dir: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    max_positions: int | None = None,
    int4_kernel: str = "auto",
    lm_head: str = "auto",
    fused_decoder: bool = True,
    shard: ShardSpec | None = None,
    group: torch.distributed.ProcessGroup | None = None,
) -> CausalLM:
    """Build the model for `model_dir/config.json` and fill it from its safetensors.

    The model is built on the meta device; each projection is created with its weights
    (fused q/k/v and gate/up; dense or quantized per `quantization_config`), then the
    embeddings and norms are assigned. Raises `MissingWeightError` naming the first absent
    tensor, `UnsupportedModelError` / `UnsupportedQuantizationError` for what we lack.
    `int4_kernel` picks the CPU int4 kernel (auto, w4a8, torch). `lm_head` "int8" computes
    logits with an int8 copy of the output head (CPU, AVX2), "int4" with a 4-bit one (CPU,
    AVX2; tied embeddings then read the same 4-bit rows: `quant.int4_head`), "dense" with
    the checkpoint's weights, "auto" int8 for quantized checkpoints on a CPU with bf16
    compute.
    `fused_decoder` runs all decoder layers in one C++ call on CPU-kernel steps where the
    model allows it (W4A8 or dense CPU projections; see `fused_decoder.py`), else layer by
    layer.
    With `shard` (and its process `group`), only that tensor-parallel rank's slice of the
    projections is loaded and an all-reduce follows each row-parallel one
    (`tensor_parallel.py`); dense checkpoints only, no fused decoder.
    """
    model_dir = Path(model_dir)
    device = torch.device(device)
    config = ModelConfig.from_dir(model_dir)
    dtype = resolve_dtype(config, device, dtype)
    max_positions = max_positions or config.max_position_embeddings
    quantization = create_quantization(config.quantization_config, int4_kernel)
    with ExitStack() as stack, torch.no_grad():
        checkpoint = _Checkpoint(model_dir, stack, config)
        get = checkpoint.get if shard is None else shard.slicer(checkpoint.get)

        def linear(prefixes: list[str], bias: bool) -> torch.nn.Module:
            modules = [checkpoint.module(prefix) for prefix in prefixes]
            return quantization.load_linear(get, modules, bias, dtype, device)

        model = create_model(config if shard is None else shard.config, linear, max_positions,
                             device)  # fmt: skip
        # Everything still on the meta device (embeddings, norms) is a plain tensor to assign.
        state = {
            name: checkpoint.get(_checkpoint_name(name, config.architecture)).to(
                dtype=dtype, device=device
            )
            for name, param in model.named_parameters()
            if param.is_meta
        }
        model.load_state_dict(state, strict=False, assign=True)
        if shard is not None and shard.world_size > 1:  # after: wrapping renames parameters
            assert group is not None, "a tensor-parallel shard needs its process group"
            wrap_row_parallel(model, group)
            fused_decoder = False  # the C++ decoder has no all-reduce between its layers
    leftover = [name for name, param in model.named_parameters() if param.is_meta]
    if leftover:
        raise MissingWeightError(f"{model_dir}: weights not loaded: {', '.join(leftover[:5])}")
    model.requires_grad_(False)
    model.eval()
    with torch.no_grad():
        for module in model.modules():  # derived tensors, now that the weights are final
            if hasattr(module, "finish_loading"):
                module.finish_loading()
    if fused_decoder and device.type == "cpu":
        model.use_fused_decoder()
    head = _quantized_head(lm_head, config, device, dtype)
    if head == "int8" and not model.use_int8_head() and lm_head == "int8":
        raise ValueError(
            f"{model_dir}: the output head cannot run in int8 (quantized or odd width)"
        )
    if head == "int4":
        if not model.use_int4_head():
            raise ValueError(
                f"lm_head int4: {model_dir}'s output head cannot run in int4 (quantized in the "
                "checkpoint, with a bias, or a width that is not a multiple of 64)"
            )
        tied = " (the tied embedding reads its rows)" if config.tie_word_embeddings else ""
        logger.info("%s: logits from a 4-bit copy of the output head%s", model_dir, tied)
    unused = set(checkpoint.location) - checkpoint.used
    if unused:
        logger.info(
            "%s: %d checkpoint tensors unused, e.g. %s", model_dir, len(unused), min(unused)
        )
    return model


def _quantized_head(
    lm_head: str, config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> str | None:
    """The quantized head `lm_head` asks for here ("int8", "int4"), or None (dense)."""
    if lm_head not in LM_HEADS:
        raise ValueError(f"lm_head {lm_head!r}; supported: {', '.join(LM_HEADS)}")
    if lm_head == "dense":
        return None
    available = device.type == "cpu" and cpu_kernels.load()
    if lm_head in ("int8", "int4"):
        if device.type != "cpu":
            raise ValueError(
                f"lm_head {lm_head} runs on modelship's CPU kernels, not on {device.type}: "
                "use auto or dense there"
            )
        if not available:
            raise ValueError(f"an {lm_head} output head needs modelship's CPU kernels (AVX2)")
        return lm_head
    quantized = available and bool(config.quantization_config) and dtype == torch.bfloat16
    return "int8" if quantized else None


def _checkpoint_name(name: str, architecture: str) -> str:
    """Our parameter name -> HF's: we drop the `model.` and `self_attn.` module levels, and
    call every MLP `mlp` (Mixtral's MoE block is `block_sparse_moe`)."""
    block = moe_block(architecture)
    if block != "mlp":
        name = name.replace(".mlp.", f".{block}.")
    for norm in (".q_norm.", ".k_norm."):
        name = name.replace(norm, f".self_attn{norm}")
    if name.startswith(("embed_tokens.", "norm.", "layers.")):
        return f"model.{name}"
    return name


def read_generation_eos(model_dir: Path | str) -> set[int]:
    """EOS ids from generation_config.json (often more complete than config.json's)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}
