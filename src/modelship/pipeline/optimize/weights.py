"""Checkpoint file helpers shared by the schemes: casting safetensors, copying tokenizers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def cast_checkpoint(src_dir: Path, out_dir: Path, dtype: str) -> None:
    """Write `src_dir`'s safetensors with every floating tensor cast to `dtype`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(src_dir.glob("*.safetensors")):
        _cast_file(path, out_dir / path.name, torch_dtype(dtype))
    for index in src_dir.glob("*.safetensors.index.json"):
        shutil.copyfile(index, out_dir / index.name)
    config = json.loads((src_dir / "config.json").read_text())
    _set_config_dtype(config, dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def cast_floating_in_place(folder: Path, dtype: str) -> None:
    """Cast the floating tensors of a (quantized) checkpoint; integer tensors stay as they are.

    llm-compressor calibrates in fp32 and keeps the unquantized tensors (embeddings, norms,
    scales) in fp32; halving them is what makes a 4-bit variant small in memory.
    """
    for path in sorted(folder.glob("*.safetensors")):
        _cast_file(path, path, torch_dtype(dtype))
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    _set_config_dtype(config, dtype)
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def copy_tokenizer_files(src_dir: Path, out_dir: Path) -> None:
    for name in _SIDE_FILES:
        if (src_dir / name).is_file() and not (out_dir / name).exists():
            shutil.copyfile(src_dir / name, out_dir / name)


def _cast_file(src: Path, dst: Path, dtype: torch.dtype) -> None:
    tensors = load_file(src)
    cast = {
        name: (t.to(dtype) if t.is_floating_point() else t).contiguous()
        for name, t in tensors.items()
    }
    save_file(cast, dst, metadata={"format": "pt"})


def _set_config_dtype(config: dict, dtype: str) -> None:
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
