"""What a model folder says about its embeddings: how hidden states are pooled and how many
dimensions they have. Read once, when the server starts (`OpenAIServing`), not per request."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EmbeddingShape:
    pooling: str  # "mean" or "last" (`SamplingParams.pooling`)
    dimensions: int | None  # the hidden size; None when the folder does not say

    @classmethod
    def of(cls, model_dir: Path | None) -> EmbeddingShape:
        return cls(pooling_of(model_dir), hidden_size_of(model_dir))


def pooling_of(model_dir: Path | None) -> str:
    """Mean pooling where the folder's sentence-transformers config asks for it, else the
    last token's state."""
    config = (model_dir / "1_Pooling" / "config.json") if model_dir else None
    if config is not None and config.is_file():
        mean = json.loads(config.read_text()).get("pooling_mode_mean_tokens")
        return "mean" if mean else "last"
    return "last"


def hidden_size_of(model_dir: Path | None) -> int | None:
    config = (model_dir / "config.json") if model_dir else None
    if config is None or not config.is_file():
        return None
    data = json.loads(config.read_text())
    return data.get("hidden_size") or (data.get("text_config") or {}).get("hidden_size")


def model_dir_of(tokenizer: object) -> Path | None:
    """The folder the tokenizer (and so the model) was loaded from, if it is one."""
    name = getattr(tokenizer, "name_or_path", None)
    return Path(name) if name and Path(name).is_dir() else None
