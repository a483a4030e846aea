"""Convert a GGUF file into a Hugging Face safetensors folder (weights, config, tokenizer)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from unittest import mock

from rich.progress import Progress

from modelship.pipeline.errors import AcquireError
from modelship.progress import rich_tqdm_class

GGUF_MAGIC = b"GGUF"


def check_gguf_header(path: Path) -> None:
    """Fail fast, with the file's name, on anything that is not a GGUF file."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise AcquireError(f"{path}: cannot read ({exc.strerror})") from exc
    if magic != GGUF_MAGIC:
        raise AcquireError(f"{path}: not a GGUF file (bad magic {magic!r}, expected b'GGUF')")


def convert_gguf(path: Path, out_dir: Path, progress: Progress | None = None) -> dict:
    """Write `path` as an HF folder into `out_dir`; return facts for the manifest.

    The GGUF tensors are dequantized to fp32 by transformers. `save_pretrained` refuses a
    model loaded from GGUF ("quantized with gguf, not serializable"), so the weights are
    moved into a fresh model whose config has no `quantization_config`; the logits stay
    identical to transformers' own GGUF load.
    """
    check_gguf_header(path)
    import torch
    import transformers
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()  # its shard-writing bar
    # transformers dequantizes tensor by tensor under a bare tqdm bar; draw it with rich.
    bar = (
        mock.patch.object(gguf_utils, "tqdm", rich_tqdm_class(progress))
        if progress is not None
        else nullcontext()
    )
    steps = ["read and dequantize GGUF", "rebuild model", "write safetensors", "tokenizer"]
    task = progress.add_task(f"convert {path.name}", total=len(steps)) if progress else None

    def advance(step: int) -> None:
        if progress is not None and task is not None:
            progress.update(task, completed=step, description=f"convert: {steps[step]}")

    advance(0)
    try:
        with bar:
            loaded = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # the GGUF reader raises many unrelated types on bad input
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AcquireError(f"{path}: cannot be converted as a GGUF model ({reason})") from exc

    advance(1)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    state = loaded.state_dict()
    del loaded
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(state, strict=True, assign=True)
    fresh.tie_weights()

    advance(2)
    fresh.save_pretrained(out_dir, safe_serialization=True)
    advance(3)
    tokenizer.save_pretrained(out_dir)
    if progress is not None and task is not None:
        progress.update(task, completed=len(steps), description=f"converted {path.name}")
    return {
        "architecture": type(fresh).__name__,
        "num_parameters": sum(p.numel() for p in fresh.parameters()),
        "has_chat_template": bool(getattr(tokenizer, "chat_template", None)),
    }
