"""Random-weight models for benchmarks/gpu.py: Llama shapes saved with transformers, a
word-level tokenizer, and a compressed-tensors W4A16 (pack-quantized) copy written as
llm-compressor writes it. Needs torch, transformers and this repository's source only.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch

from modelship.model.quant.compressed_tensors import pack_linear

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# Llama-3.2-1B's shape (tied embeddings as it has; SmolLM2's 49k vocabulary) and SmolLM2-135M's.
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# Models ------------------------------------------------------------------------------------
def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `<pad> <s> </s> t3 ... t{vocab_size - 1}`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab |= {f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(folder)


def build_model(folder: Path, shape: dict, dtype: torch.dtype, device: str, seed: int) -> Path:
    """A random-weight LlamaForCausalLM of `shape`, saved in `dtype` with a tokenizer."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **shape,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialising 1B parameters is much faster on the GPU
        model = LlamaForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(folder)
    write_tokenizer(folder, shape["vocab_size"])
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder


def quantize_rtn(
    weight: torch.Tensor, group_size: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit, compressed-tensors' min-max rules: u [out, in] in [0, 15],
    scale [out, in / group_size] in weight's dtype, signed zero_point (zeros if symmetric),
    so that `dequantize(u, scale, zero_point)` is the quantized weight."""
    out_features, in_features = weight.shape
    w = weight.float().view(out_features, in_features // group_size, group_size)
    w_min = w.amin(-1).clamp(max=0)
    w_max = w.amax(-1).clamp(min=0)
    if symmetric:
        scale = torch.maximum(-w_min, w_max) / 7.5  # (q_max - q_min) / 2
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
    else:
        scale = (w_max - w_min) / 15
        zero_point = (-8 - torch.round(w_min / scale.clamp(min=1e-12))).clamp(-8, 7).int()
    scale = scale.clamp(min=1e-8).to(weight.dtype)  # stored (and applied) in weight's dtype
    q = torch.round(w / scale.float().unsqueeze(-1)) + zero_point.unsqueeze(-1)
    u = (q.clamp(-8, 7) + 8).int().view(out_features, in_features)
    return u, scale, zero_point


def quantization_config(group_size: int, symmetric: bool) -> dict:
    """`quantization_config` as llm-compressor 0.14 writes it for a W4A16 recipe."""
    weights = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": group_size,
        "num_bits": 4,
        "observer": "minmax",
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": "group",
        "symmetric": symmetric,
        "type": "int",
        "zp_dtype": None if symmetric else "torch.int8",
    }
    group = {
        "format": "pack-quantized",
        "input_activations": None,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": weights,
    }
    return {
        "config_groups": {"group_0": group},
        "format": "pack-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.13.0",
    }


def write_w4a16_checkpoint(
    dense_dir: Path, out_dir: Path, group_size: int = 128, symmetric: bool = True
) -> Path:
    """`dense_dir`'s Llama as a compressed-tensors pack-quantized W4A16 checkpoint: every
    decoder projection 4-bit (round to nearest), embeddings, norms and head as they were."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    dense: dict[str, torch.Tensor] = {}
    for file in sorted(dense_dir.glob("*.safetensors")):  # sharded or not
        dense |= load_file(file)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in dense.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in PROJECTIONS:
            u, scale, zero_point = quantize_rtn(tensor, group_size, symmetric)
            packed = pack_linear(u, scale, None if symmetric else zero_point)
            tensors |= {f"{prefix}.{suffix}": t for suffix, t in packed.items()}
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(group_size, symmetric)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for file in dense_dir.iterdir():
        skip = file.suffix == ".safetensors" or file.name.startswith("model.safetensors")
        if file.is_file() and not skip and file.name != "config.json":
            (out_dir / file.name).write_bytes(file.read_bytes())
    return out_dir
