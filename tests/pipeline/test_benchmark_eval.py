"""The standard multiple-choice set: fetched from a (here: tiny, made in the test) BIG-bench
sdist into the cache, read from there, and scored like lm-eval on a tiny model."""

from __future__ import annotations

import io
import json
import math
import tarfile
from pathlib import Path

import pytest
import torch

from modelship.pipeline.select import benchmark_data as bd
from modelship.pipeline.select.multiple_choice import encode_pair, score_choices
from modelship.pipeline.select.quality import Scorer


def make_sdist(path: Path, tasks: dict[str, dict]) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for task, data in tasks.items():
            body = json.dumps(data).encode()
            info = tarfile.TarInfo(f"bigbench-1.0.0/bigbench/benchmark_tasks/{task}/task.json")
            info.size = len(body)
            archive.addfile(info, io.BytesIO(body))
    return path


def task(n: int) -> dict:
    examples = [
        {"input": f"Question {i}?", "target_scores": {"yes": int(i % 2 == 0), "no": int(i % 2)}}
        for i in range(n)
    ]
    examples.append({"input": "tied", "target_scores": {"x": 1, "y": 1}})  # no single answer
    return {"name": "t", "examples": examples}


def test_tasks_extract_to_the_cache_and_load_interleaved(tmp_path: Path) -> None:
    sdist = make_sdist(tmp_path / bd.SDIST, {"alpha": task(3), "beta": task(5)})
    cache = tmp_path / "cache"
    bd.extract_tasks(sdist, ["alpha", "beta"], cache)
    rows = [json.loads(x) for x in bd.task_path(cache, "alpha").read_text().splitlines()]
    assert rows[1] == {"id": "alpha/1", "input": "Question 1?", "choices": ["yes", "no"],
                       "answer": 1}  # fmt: skip
    assert len(rows) == 3  # the tied example is left out

    loaded = bd.load_benchmark(cache, ["alpha", "beta"], max_items=7)
    assert [i.id for i in loaded.items] == ["alpha/0", "beta/0", "alpha/1", "beta/1",
                                            "alpha/2", "beta/2", "beta/3"]  # fmt: skip
    assert loaded.items[0].context == "Q: Question 0?\nA:"
    described = loaded.describe()
    assert described["dataset"] == "bigbench" and described["version"] == "1.0.0"
    assert described["tasks"]["beta"] == bd.sha256_of(bd.task_path(cache, "beta"))

    with pytest.raises(bd.BenchmarkDataError, match="no task named gamma"):
        bd.extract_tasks(sdist, ["gamma"], cache)


def test_a_missing_task_file_names_the_file_and_the_fetch_command(tmp_path: Path) -> None:
    with pytest.raises(bd.BenchmarkDataError) as error:
        bd.load_benchmark(tmp_path, ["social_iqa"], max_items=10)
    assert str(bd.task_path(tmp_path, "social_iqa")) in str(error.value)
    assert "make data" in str(error.value)


def test_fetch_refuses_an_sdist_with_another_checksum(tmp_path: Path) -> None:
    sdist = make_sdist(tmp_path / bd.SDIST, {"alpha": task(2)})
    with pytest.raises(bd.BenchmarkDataError, match="expected " + bd.SDIST_SHA256):
        bd.fetch(tmp_path / "cache", ["alpha"], sdist=sdist)
    assert not bd.task_path(tmp_path / "cache", "alpha").exists()


def test_choices_are_scored_by_their_loglikelihood_like_lm_eval(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    scorer = Scorer(tiny_llama_dir, max_model_len=256)
    items = [
        bd.ChoiceItem("a", "Q: the cat sat on\nA:", ("the mat", "a dog", "x"), 0),
        bd.ChoiceItem("b", "Q: one two three\nA:", ("four", "five six seven"), 1),
    ]
    scores = score_choices(scorer, items)

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    for item, score in zip(items, scores, strict=True):
        expected = []
        for choice in item.choices:
            context, continuation = encode_pair(scorer.tokenizer, item.context, " " + choice)
            ids = torch.tensor([context + continuation])
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            expected.append(
                sum(lp[len(context) - 1 + k, t].item() for k, t in enumerate(continuation))
            )
        # the engine computes in bfloat16 on CPU: a few hundredths per token
        assert score.loglikelihoods == pytest.approx(expected, abs=0.1)
        mine = list(score.loglikelihoods)
        assert score.correct == (mine.index(max(mine)) == item.answer)
        normed = [ll / len(c) for ll, c in zip(mine, item.choices, strict=True)]
        assert score.correct_norm == (normed.index(max(normed)) == item.answer)
        total = sum(math.exp(ll) for ll in mine)
        assert score.choice_prob == pytest.approx(math.exp(mine[item.answer]) / total)


def test_encode_pair_moves_the_contexts_trailing_space_to_the_continuation(
    tiny_llama_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    context, continuation = encode_pair(tokenizer, "Q: hi\nA: ", "yes")
    assert context == tokenizer("Q: hi\nA:", add_special_tokens=False).input_ids
    whole = tokenizer("Q: hi\nA: yes", add_special_tokens=False).input_ids
    assert context + continuation == whole


def test_encode_pair_moves_a_trailing_newline_too_like_lm_eval(tiny_llama_dir: Path) -> None:
    """lm-eval strips every trailing whitespace character off the context, not only spaces."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    context, continuation = encode_pair(tokenizer, "Q: hi\nA:\n", " yes")
    assert context == tokenizer("Q: hi\nA:", add_special_tokens=False).input_ids
    whole = tokenizer("Q: hi\nA:\n yes", add_special_tokens=False).input_ids
    assert context + continuation == whole
