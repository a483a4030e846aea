"""The model a benchmark runs when none is given: the demo model, acquired once into the
storage root (later runs find it there)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STORAGE = ROOT / "modelship-data"


def model_or_demo(model: Path | None, storage: Path = DEFAULT_STORAGE) -> Path:
    if model is not None:
        return model
    from modelship.pipeline.acquire import acquire
    from modelship.storage import Storage

    return acquire("demo", Storage(storage)).path
