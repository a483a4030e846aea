"""A pipeline config small enough for tests: tiny calibration, a short workload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modelship.config import ModelshipConfig

TINY: dict[str, Any] = {
    "optimize": {
        "recipes": {
            "gptq": {"num_calibration_samples": 4, "max_seq_length": 64},
            "awq": {"num_calibration_samples": 4, "max_seq_length": 64},
        }
    },
    "select": {
        "eval_chunks": 2,
        "eval_chunk_tokens": 32,
        "latency_requests": 1,
        "concurrency": 2,
        "throughput_requests": 2,
        "prompt_tokens": 16,
        "output_tokens": 4,
        "min_rounds": 2,
        "max_rounds": 2,
        # Random weights score near chance on the task set and babble on golden prompts;
        # here the quality gate only has to catch a variant that is actually broken.
        "gates": {"min_quality_share": 0.6, "max_repetition": 1.0, "min_printable": 0.0},
    },
    "serve": {"engine": {"max_model_len": 256, "kv_cache_memory_mb": 16}},
}


def tiny_config(source: Path, storage: Path, **sections: Any) -> ModelshipConfig:
    data = {**TINY, "source": str(source), "name": "tiny", "storage": str(storage)}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return ModelshipConfig.from_dict(data)
