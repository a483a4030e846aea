"""Shared fixtures: tiny random models and the demo model, built once per session."""

from __future__ import annotations

import fcntl
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from modelship.storage import Storage

from tiny_models import make_tiny_llama


def _can_run_cuda() -> bool:
    """A CUDA build of torch on a machine with an NVIDIA device, read from files (importing
    torch here would cost every test session seconds)."""
    spec = importlib.util.find_spec("torch")
    builds = spec.submodule_search_locations if spec is not None else None
    cuda_build = any((Path(p) / "lib" / "libtorch_cuda.so").exists() for p in builds or ())
    return cuda_build and Path("/dev/nvidiactl").exists()


# Triton runs kernels on CPU tensors only in its interpreter, and reads TRITON_INTERPRET when
# it decorates a kernel: its own library's at its first import, which test modules trigger
# at collection (transformers imports triton). So without a GPU it is set here, before any
# of them (tests/model/test_triton_attention.py, tests/engine/test_cuda_graphs.py).
if not _can_run_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


def run_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This test run's temp folder: one session's own, or under pytest-xdist the folder its
    workers' session folders share (each worker is a session of its own)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]):
    """The folder `name`, built once per test run by `build(folder)` (seconds of CPU each
    time): the first worker to ask builds it while the others wait on a lock, then all read
    the finished folder, which appears by a rename only once complete."""
    root = run_temp_dir(tmp_path_factory)
    target = root / name
    with open(root / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        if not target.exists():
            staging = tmp_path_factory.mktemp(f"{name}-building")
            build(staging)
            staging.rename(target)
    return target


@pytest.fixture(scope="session")
def demo_storage(tmp_path_factory: pytest.TempPathFactory) -> Storage:
    """A storage root holding the acquired demo model, shared by the run's workers: acquire
    is memoized and locks its target, so the GGUF conversion runs once per test run."""
    from modelship.pipeline.acquire import acquire

    storage = Storage(run_temp_dir(tmp_path_factory) / "demo-storage")
    acquire("demo", storage)
    return storage


@pytest.fixture(scope="session")
def demo_model_dir(demo_storage: Storage) -> Path:
    from modelship.pipeline.acquire import DEMO_SLUG

    return demo_storage.base_dir(DEMO_SLUG)


@pytest.fixture(scope="session")
def demo_int4_dir(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model quantized with llm-compressor's round-to-nearest W4A16 at group size 64
    (seconds): the layout the optimize stage writes, on the W4A8 kernel. Built once per run."""
    return built_once(
        tmp_path_factory, "demo-int4", lambda out: _quantize_demo(demo_model_dir, out)
    )


def _quantize_demo(demo_model_dir: Path, out: Path) -> None:
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}
    modifier = QuantizationModifier(
        targets="Linear",
        ignore=["lm_head"],
        config_groups={"g": {"targets": ["Linear"], "weights": weights | {"symmetric": True}}},
    )
    oneshot(model=model, recipe=[modifier])
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(demo_model_dir).save_pretrained(out)
    for name in ("generation_config.json",):
        if (demo_model_dir / name).exists():
            (out / name).write_bytes((demo_model_dir / name).read_bytes())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Test files marked `long` run first, in the order collected; then the rest. `make test`
    hands pytest-xdist's workers whole files in this order (`--no-loadscope-reorder`): its
    default order, most tests first, leaves the long end-to-end files (a few tests each, a
    minute or several in all) for the end, where one worker runs the last of them alone
    while the other has nothing left to take."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
