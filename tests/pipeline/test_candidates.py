"""Select's served-numerics candidates (`pipeline/select/candidates.py`): which int4 variant
gets the 4-bit-head candidate, when none is proposed, and the replica flags it runs with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelship.engine.options import EngineOptions
from modelship.model import cpu_kernels
from modelship.pipeline.select.candidates import Candidate, int4_head_candidate
from modelship.serve_options import ServeOptions
from modelship.storage import Storage

RECIPES = {
    "fp16": {"scheme": "fp16", "dtype": "float16", "bits": None},
    "awq": {"scheme": "awq", "bits": 4, "group_size": 64},
    "gptq": {"scheme": "gptq", "bits": 4, "group_size": 64},
}


@pytest.fixture
def storage(tiny_llama_dir: Path, tmp_path: Path) -> Storage:
    """Three optimized variants of `tiny` (the tiny model's config.json, hidden size 64)
    whose manifests say what their recipes wrote."""
    storage = Storage(tmp_path / "data")
    for variant, recipe in RECIPES.items():
        target = storage.variant_dir("tiny", variant)
        with (
            storage.lock(target),
            storage.publish(
                target, kind="optimized", source="test", revision=None, inputs_hash=variant,
                extra={"variant": variant, "recipe": recipe},
            ) as staging,
        ):  # fmt: skip
            (staging / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    return storage


def measured(**kl: float) -> dict[str, dict]:
    return {name: {"variant": name, "quality": {"kl_divergence": v}} for name, v in kl.items()}


@pytest.mark.skipif(not cpu_kernels.load(), reason="the 4-bit head needs modelship's kernels")
def test_the_int4_variant_closest_to_the_base_gets_the_head(storage: Storage) -> None:
    variants = ["fp16", "awq", "gptq"]
    serve = ServeOptions()
    # fp16 is closest of all, but its weights are not 4-bit: the head is the int4 variants'
    head = int4_head_candidate(storage, "tiny", measured(fp16=0.0, awq=0.2, gptq=0.1),
                               variants, serve)  # fmt: skip
    assert head == Candidate("gptq-int4head", "gptq", {"lm_head": "int4"})
    head = int4_head_candidate(storage, "tiny", measured(awq=0.1, gptq=0.2), variants, serve)
    assert head is not None and head.variant == "awq"
    # a variant that failed to load has no quality: not a candidate's source
    failed = measured(awq=0.1) | {"gptq": {"variant": "gptq", "load_error": "boom"}}
    assert int4_head_candidate(storage, "tiny", failed, variants, serve).variant == "awq"
    assert int4_head_candidate(storage, "tiny", measured(fp16=0.0), ["fp16"], serve) is None
    # a hidden size the kernel's groups of 64 do not divide: no candidate, not a failed one
    config = storage.variant_dir("tiny", "awq") / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"hidden_size": 96}))
    assert int4_head_candidate(storage, "tiny", measured(awq=0.1), variants, serve) is None


def test_no_head_candidate_where_the_head_is_pinned_or_replicas_run_on_a_gpu(
    storage: Storage,
) -> None:
    evaluations = measured(awq=0.2, gptq=0.1)
    for engine in (EngineOptions(lm_head="dense"), EngineOptions(lm_head="int8"),
                   EngineOptions(device="cuda")):  # fmt: skip
        serve = ServeOptions(engine=engine)
        assert int4_head_candidate(storage, "tiny", evaluations, ["awq", "gptq"], serve) is None


def test_a_candidate_runs_its_replica_with_its_numerics() -> None:
    head = Candidate("gptq-int4head", "gptq", {"lm_head": "int4"})
    base = ServeOptions(engine=EngineOptions(max_model_len=256), variant=head.name)
    args = head.serve_options(base).replica_args()
    assert args[args.index("--lm-head") + 1] == "int4"
    assert args[args.index("--max-model-len") + 1] == "256"  # pipeline.yaml's options kept
    plain = Candidate("gptq", "gptq")
    assert plain.serve_options(base) is base
    evaluation = {"variant": "gptq-int4head", "source_variant": "gptq", "engine": head.engine}
    assert Candidate.of(evaluation) == head and Candidate.of({"variant": "awq"}).variant == "awq"
