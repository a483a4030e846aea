"""Which device names the engine takes, and whether this machine's torch can use one.

Two checks, apart on purpose: `check_device_name` is configuration (pipeline.yaml and the
`--device` flag; a render for a GPU cluster made on a laptop must accept `cuda`), imports
nothing heavy; `device_problem` asks this process's torch, at `serve` start, before a model
loads, so `--device cuda` on a CPU-only build is one line instead of a traceback from deep
inside the loader.
"""

from __future__ import annotations

import re

DEVICE_TYPES = ("cpu", "cuda", "auto")
_DEVICE_RE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")


def check_device_name(device: str) -> str:
    """`device` if it is `cpu`, `cuda`, `cuda:N` or `auto` (cuda where torch sees a GPU, else
    cpu: `engine.options.resolve_device`); else a ValueError naming the choices."""
    if not _DEVICE_RE.match(device):
        hint = " (a GPU is `cuda`)" if device.lower() in ("gpu", "nvidia") else ""
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}{hint}")
    return device


def device_problem(device: str) -> str | None:
    """Why this process cannot run on `device` (a valid name), with the fix; None if it can."""
    if not device.startswith("cuda"):
        return None
    import torch

    if torch.version.cuda is None:
        return (
            f"--device {device}: this torch ({torch.__version__}) is built without CUDA; "
            "serve with --device cpu, or install a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    if count == 0:
        return (
            f"--device {device}: no CUDA device is visible (check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES), or serve with --device cpu"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        return f"--device {device}: only {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})"
    return None
