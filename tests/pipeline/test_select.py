"""Select on a tiny model: every variant measured, broken ones gated with reasons, a
release published and production switched, memoized reruns, rollback."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from modelship.pipeline.errors import PipelineError
from modelship.pipeline.optimize import optimize
from modelship.pipeline.run import run_pipeline
from modelship.pipeline.select.runner import select
from modelship.release.golden import read_reference
from modelship.release.traffic import rollback
from modelship.storage import Storage, read_manifest

from pipeline_config import tiny_config

# a pipeline run and reruns, about 2 minutes in CI: handed to a worker first (tests/conftest.py)
pytestmark = pytest.mark.long


def publish_broken(storage: Storage, name: str, damage) -> None:
    """A variant folder made from fp16 and then damaged, published like a real one."""
    source = storage.variant_dir("tiny", "fp16")
    target = storage.variant_dir("tiny", name)
    with (
        storage.lock(target),
        storage.publish(
            target, kind="optimized", source=str(source), revision=None, inputs_hash=name
        ) as staging,
    ):
        for path in source.iterdir():
            if path.name != "manifest.json":
                shutil.copy(path, staging / path.name)
        damage(staging)


def scale_weights(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    save_file({k: v * 40 for k, v in tensors.items()}, folder / "model.safetensors")


def break_config(folder: Path) -> None:
    (folder / "config.json").write_text("{ not json")


@pytest.fixture(scope="module")
def pipeline(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("select")
    config = tiny_config(tiny_llama_dir, root / "data")
    storage = Storage(config.storage)
    slug, records = run_pipeline(config, storage)
    assert slug == "tiny"
    return config, storage, records


def test_all_variants_load_in_our_engine_and_in_transformers(pipeline) -> None:
    from transformers import AutoModelForCausalLM

    from modelship import LLM, SamplingParams

    _config, storage, records = pipeline
    assert {name for name in records} == {"acquire", "optimize:fp16", "optimize:awq",
                                          "optimize:gptq", "select"}  # fmt: skip
    for variant in ("fp16", "awq", "gptq"):
        folder = storage.variant_dir("tiny", variant)
        manifest = read_manifest(folder)
        assert manifest.extra["recipe"]["scheme"] == variant
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()
        llm = LLM(folder, dtype="float32", num_kv_blocks=32, block_size=4)
        [output] = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
        assert len(output.outputs[0].token_ids) == 3


def test_release_is_published_with_evaluations_and_report(pipeline) -> None:
    _config, storage, records = pipeline
    winner = records["select"].facts["winner"]
    assert storage.production_release("tiny") == records["select"].facts["release"] == 1
    production = storage.production_link("tiny")
    metrics = json.loads((production / "production_metrics.json").read_text())
    assert metrics["variant"] == winner and metrics["ranking"][0]["variant"] == winner
    for variant in ("base", "fp16", "awq", "gptq"):
        evaluation = json.loads((storage.evaluations_dir("tiny") / f"{variant}.json").read_text())
        assert evaluation["quality"]["num_task_items"] >= 50
    gptq = json.loads((storage.evaluations_dir("tiny") / "gptq.json").read_text())
    assert gptq["serving"]["throughput_tok_s"] > 0 and gptq["serving"]["failed_requests"] == 0
    fp16 = json.loads((storage.evaluations_dir("tiny") / "fp16.json").read_text())
    assert gptq["weight_bytes"] < 0.85 * fp16["weight_bytes"]  # embeddings stay 16-bit
    report = (production / "report.md").read_text()
    assert f"**{winner}** won" in report and "## Metrics" in report
    assert "<svg" in (production / "report.html").read_text()


def test_broken_variants_are_gated_and_the_report_says_why(pipeline) -> None:
    config, storage, _ = pipeline
    publish_broken(storage, "scaled", scale_weights)
    publish_broken(storage, "unloadable", break_config)
    variants = ["fp16", "scaled", "unloadable"]
    result = select(storage, "tiny", config, variants=variants, log=lambda _: None)
    by_name = {s.variant: s for s in result.scores}
    assert result.winner == "fp16" and result.new_release
    assert not by_name["scaled"].passed
    assert any("quality" in r and "below the 60% gate" in r for r in by_name["scaled"].reasons)
    assert not by_name["unloadable"].passed
    assert by_name["unloadable"].reasons[0].startswith("failed to load")
    report = (storage.release_dir("tiny", result.release) / "report.md").read_text()
    assert "**scaled** was gated out: quality" in report
    assert "**unloadable** was gated out: failed to load" in report


def test_rerun_is_memoized_and_rollback_switches_back(pipeline) -> None:
    config, storage, _ = pipeline
    before = storage.production_release("tiny")
    messages: list[str] = []
    again = select(storage, "tiny", config, variants=["fp16", "scaled", "unloadable"],
                   log=messages.append)  # fmt: skip
    assert not again.new_release and again.release == before
    assert sum("evaluation memoized" in m for m in messages) == 4  # base + 3 variants

    previous, now = rollback(storage, "tiny")
    assert (previous, now) == (before, before - 1)
    assert storage.production_release("tiny") == before - 1
    assert read_manifest(storage.production_link("tiny")).kind == "release"
    with pytest.raises(PipelineError, match="no release before 1"):
        rollback(storage, "tiny")
    with pytest.raises(PipelineError, match="release 9 does not exist"):
        rollback(storage, "tiny", to=9)
    rollback(storage, "tiny", to=before)
    assert storage.production_release("tiny") == before


def test_optimize_alone_is_memoized_after_the_run(pipeline) -> None:
    config, storage, _ = pipeline
    results = optimize(storage, "tiny", ["fp16", "awq", "gptq"], overrides=config.optimize.recipes)
    assert all(r.memoized for r in results)


def test_two_copies_of_the_same_weights_tie(pipeline) -> None:
    config, storage, _ = pipeline
    publish_broken(storage, "twin", lambda staging: None)  # fp16, byte for byte
    result = select(storage, "tiny", config, variants=["twin", "fp16"], log=lambda _: None)
    first, second = result.scores
    assert (first.variant, second.variant) == ("fp16", "twin")  # by name: nothing else differs
    assert first.score == second.score and first.normalized == second.normalized
    twin = result.evaluations["twin"]
    # quality too is a tie on the same items, and the paired difference is exactly zero
    assert twin["quality_share_differences"]["fp16"] == {"value": 0.0, "ci95": [0.0, 0.0]}
    assert twin["quality_share_ci95"] == result.evaluations["fp16"]["quality_share_ci95"]
    assert twin["quality_ci95"]["task_accuracy"][0] <= twin["quality"]["task_accuracy"]
    serving = twin["serving"]
    assert serving["rounds"] == 2 and len(serving["samples"]["ttft_s"]) == 2
    assert set(serving["ci"]) == {"ttft_s", "tpot_s", "throughput_tok_s"}
    report = (storage.release_dir("tiny", result.release) / "report.md").read_text()
    assert "Tie within noise: **fp16** and **twin**" in report and " +/- " in report
    assert "quality share minus fp16's (paired) | - | - | +0.0% [+0.0%, +0.0%] |" in report
    assert "repeated 4-grams, all golden prompts" in report


def test_a_release_carries_its_provenance(pipeline, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from modelship.cli import app

    config, storage, _ = pipeline
    release = storage.production_release("tiny")
    release_dir = storage.release_dir("tiny", release)
    record = json.loads((release_dir / "provenance.json").read_text())
    assert "provenance.json" in {e.path for e in read_manifest(release_dir).files}
    winner = record["variant"]
    source = record["measurements"][winner].get("source_variant", winner)  # -int4head: its own
    variant = read_manifest(storage.variant_dir("tiny", source))
    assert record["variants"][winner]["files"] == {e.path: e.sha256 for e in variant.files}
    assert record["variants"]["fp16"]["recipe"]["scheme"] == "fp16"
    assert record["source"]["kind"] == "base" and record["source"]["files"]
    serving = record["measurements"][winner]["serving"]
    assert serving["ttft_s"]["ci95"] > 0 and serving["rounds"] == 2
    assert record["selection"]["why"][0].startswith(f"**{winner}** won")
    assert "@" in record["published_by"]
    assert 'href="provenance.json"' in (release_dir / "report.html").read_text()
    answers = read_reference(release_dir / "golden.json")  # the drift probe's reference
    assert answers and all(len(a.tokens) == len(a.logprobs) > 0 for a in answers)

    storage_args = ["--storage", str(config.storage), "--model", "tiny"]
    runner = CliRunner()
    assert runner.invoke(app, ["rollback", *storage_args]).exit_code == 0
    shown = runner.invoke(app, ["release", "show", str(release), *storage_args])
    assert shown.exit_code == 0, shown.output
    assert f"release {release} of tiny: {winner} (not production)" in shown.output
    assert re.search(rf"measured {winner}: quality [\d.]+% \[[\d.]+%, [\d.]+%\]", shown.output)
    assert "+/-" in shown.output
    assert "variant fp16: fp16, float16 weights" in shown.output
    assert "None" not in shown.output
    as_json = json.loads(runner.invoke(app, ["release", "show", "--json", *storage_args]).output)
    assert as_json["production"] and as_json["history"][-1]["action"] == "production"
    assert as_json["history"][-1]["previous"] == release
    missing = runner.invoke(app, ["release", "show", "99", *storage_args])
    assert missing.exit_code != 0 and "release 99 does not exist" in missing.output
    runner.invoke(app, ["rollback", "--to", str(release), *storage_args])


def test_the_standard_multiple_choice_set_is_read_from_the_cache_and_recorded(pipeline) -> None:
    from modelship.pipeline.select.benchmark_data import task_path

    base_config, storage, _ = pipeline
    config = tiny_config(
        Path(base_config.source), base_config.storage,
        select={"benchmark_tasks": ["mini"], "benchmark_items": 3},
    )  # fmt: skip
    path = task_path(storage.cache_dir("eval"), "mini")
    with pytest.raises(PipelineError, match=re.escape(str(path)) + " is missing.*make data"):
        select(storage, "tiny", config, variants=["fp16"], log=lambda _: None)

    path.parent.mkdir(parents=True)
    rows = [{"id": f"mini/{i}", "input": f"{i} plus one?", "choices": [str(i + 1), "no"],
             "answer": 0} for i in range(5)]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = select(storage, "tiny", config, variants=["fp16"], log=lambda _: None)
    fp16 = result.evaluations["fp16"]
    assert len(fp16["quality"]["items"]["benchmark_correct_norm"]) == 3
    assert fp16["benchmark"]["tasks"] == {"mini": hashlib.sha256(path.read_bytes()).hexdigest()}
    assert "benchmark_acc_norm" in fp16["quality_ci95"]
    provenance = json.loads(
        (storage.release_dir("tiny", result.release) / "provenance.json").read_text()
    )
    assert provenance["measurements"]["fp16"]["benchmark"]["dataset"] == "bigbench"


def test_the_4bit_head_is_measured_as_a_candidate_and_its_release_serves_it(pipeline) -> None:
    from modelship.cli.serve_model import served_folder

    config, storage, records = pipeline
    evaluations = storage.evaluations_dir("tiny")
    [path] = evaluations.glob("*-int4head.json")  # for one int4 variant only
    head = json.loads(path.read_text())
    source = head["source_variant"]
    assert head["engine"] == {"lm_head": "int4"} and path.stem == f"{source}-int4head"
    kl = {v: json.loads((evaluations / f"{v}.json").read_text())["quality"]["kl_divergence"]
          for v in ("awq", "gptq")}  # fmt: skip
    assert source == min(kl, key=kl.get)  # the int4 variant closest to the base
    assert head["serving"]["throughput_tok_s"] > 0 and head["quality"]["num_task_items"] >= 50
    release = storage.release_dir("tiny", records["select"].facts["release"])  # the run's
    report = (release / "report.md").read_text()
    assert f"- {path.stem}: {source}'s weights served with --lm-head int4" in report
    assert f"| {path.stem} |" in report  # a row of the scores table like any variant

    # Weighted for memory only, the 4-bit head (fewer weight bytes, same weights otherwise)
    # wins over its own variant, and its release serves what was measured.
    memory = config.model_copy(
        update={"select": config.select.model_copy(
            update={"weights": {"quality": 0, "latency": 0, "throughput": 0, "memory": 1}}
        )}
    )  # fmt: skip
    messages: list[str] = []
    result = select(storage, "tiny", memory, variants=[source], log=messages.append)
    # the source and its head are memoized (the base may be measured again: an earlier test
    # of this module selects with another multiple-choice set)
    assert {f"{source}: evaluation memoized", f"{path.stem}: evaluation memoized"} <= set(messages)
    assert result.winner == path.stem, [(s.variant, s.score) for s in result.scores]
    release = storage.release_dir("tiny", result.release)
    manifest = read_manifest(release)
    assert manifest.extra["variant"] == path.stem
    assert manifest.extra["engine"] == {"lm_head": "int4"}
    weights = {(e.path, e.sha256) for e in read_manifest(storage.variant_dir("tiny", source)).files}
    assert weights <= {(e.path, e.sha256) for e in manifest.files}  # the source's files
    assert served_folder(release).measured_engine == {"lm_head": "int4"}
