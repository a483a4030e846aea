"""Does our multiple-choice scorer give lm-eval's numbers? The same BIG-bench social_iqa
items, scored twice on one model folder: by lm-eval's `local-completions` model against a
`modelship serve` of the folder on 127.0.0.1 (loglikelihood requests: echo + logprobs), and
by `pipeline/select/multiple_choice.py` through our engine in this process. Prints acc and
acc_norm of each, how many items the two agree on, and the largest difference of a choice's
log-likelihood; writes benchmarks/results/lm_eval_crosscheck.json.

    pip install -c constraints.txt lm-eval==0.4.13      # not a dependency of modelship
    python benchmarks/lm_eval_crosscheck.py \
        --model modelship-data/models/smollm2-135m-instruct/base \
        --cache modelship-data/cache/eval --items 200

lm-eval reads the items as a custom task (a YAML written here: `dataset_path: json` over a
local JSONL file of the items, the prompt `Q: {input}\\nA:`, choices after a " " target
delimiter), and its tokenizer is the model folder's: nothing comes from the Hub
(HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1 are set before either library is imported).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TASK = "social_iqa"
LM_EVAL_TASK = "modelship_crosscheck_social_iqa"
SERVED_NAME = "crosscheck"

# The same prompt as benchmark_data.context_for, written the lm-eval way (Jinja), so that a
# change on our side that lm-eval would not make shows up as a difference.
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_file}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{input | trim}}}}\\nA:"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 0
"""


@dataclass
class ItemScores:
    """Per item, in item order: each choice's summed log-likelihood, acc and acc_norm."""

    loglikelihoods: list[list[float]]
    correct: list[bool]
    correct_norm: list[bool]


def write_task(folder: Path, rows: list[dict]) -> None:
    data_file = folder / "items.jsonl"
    data_file.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    (folder / f"{LM_EVAL_TASK}.yaml").write_text(
        TASK_YAML.format(task=LM_EVAL_TASK, data_file=json.dumps(str(data_file)))
    )


def score_with_lm_eval(model: Path, task_folder: Path, batch_size: int) -> ItemScores:
    """lm-eval's local-completions against `modelship serve MODEL` (started and stopped)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from modelship.server.process import ReplicaProcess

    log = task_folder / "serve.log"
    server = ReplicaProcess(model, "--served-model-name", SERVED_NAME, log_path=log)
    try:
        server.wait_ready(timeout_s=300)
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "base_url": f"{server.url}/v1/completions",
                "model": SERVED_NAME,
                "tokenizer": str(model),
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                "batch_size": batch_size,
            },
            tasks=[LM_EVAL_TASK],
            num_fewshot=0,
            task_manager=TaskManager(include_path=str(task_folder)),
            log_samples=True,
        )
    finally:
        server.stop()
    samples = sorted(results["samples"][LM_EVAL_TASK], key=lambda s: s["doc_id"])
    return ItemScores(
        loglikelihoods=[[float(r[0]) for r in s["filtered_resps"]] for s in samples],
        correct=[bool(s["acc"]) for s in samples],
        correct_norm=[bool(s["acc_norm"]) for s in samples],
    )


def score_with_ours(model: Path, cache: Path, num_items: int) -> ItemScores:
    from modelship.pipeline.select.benchmark_data import load_benchmark
    from modelship.pipeline.select.multiple_choice import score_choices
    from modelship.pipeline.select.quality import Scorer

    items = load_benchmark(cache, [TASK], num_items).items
    scores = score_choices(Scorer(model, max_model_len=512), items)
    return ItemScores(
        loglikelihoods=[list(s.loglikelihoods) for s in scores],
        correct=[s.correct for s in scores],
        correct_norm=[s.correct_norm for s in scores],
    )


def compare(ours: ItemScores, theirs: ItemScores) -> dict:
    n = len(ours.correct)
    if len(theirs.correct) != n:
        raise SystemExit(f"lm-eval scored {len(theirs.correct)} items, ours {n}")
    gaps = [
        abs(a - b)
        for mine, its in zip(ours.loglikelihoods, theirs.loglikelihoods, strict=True)
        for a, b in zip(mine, its, strict=True)
    ]
    return {
        "num_items": n,
        "acc": {"lm_eval": sum(theirs.correct) / n, "ours": sum(ours.correct) / n},
        "acc_norm": {"lm_eval": sum(theirs.correct_norm) / n, "ours": sum(ours.correct_norm) / n},
        "items_agreeing_acc": _agreeing(ours.correct, theirs.correct),
        "items_agreeing_acc_norm": _agreeing(ours.correct_norm, theirs.correct_norm),
        "max_abs_loglikelihood_difference": max(gaps),
        "mean_abs_loglikelihood_difference": sum(gaps) / len(gaps),
    }


def _agreeing(ours: list[bool], theirs: list[bool]) -> int:
    return sum(a == b for a, b in zip(ours, theirs, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a model folder")
    parser.add_argument("--cache", type=Path, required=True, help="e.g. modelship-data/cache/eval")
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per lm-eval request")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/lm_eval_crosscheck.json")
    )
    args = parser.parse_args()
    # Before lm-eval, datasets or transformers are imported: they read these at import.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    from modelship.pipeline.select.benchmark_data import task_path

    rows = [json.loads(line) for line in task_path(args.cache, TASK).read_text().splitlines()]
    seconds = {}
    with tempfile.TemporaryDirectory(prefix="modelship-crosscheck-") as tmp:
        os.environ["HF_DATASETS_CACHE"] = str(Path(tmp) / "datasets")
        write_task(Path(tmp), rows[: args.items])
        started = time.perf_counter()
        theirs = score_with_lm_eval(args.model, Path(tmp), args.batch_size)
        seconds["lm_eval"] = time.perf_counter() - started
    started = time.perf_counter()
    ours = score_with_ours(args.model, args.cache, args.items)
    seconds["ours"] = time.perf_counter() - started
    summary = compare(ours, theirs)
    n = summary["num_items"]
    print(f"{args.model}: {n} {TASK} items; seconds: lm-eval {seconds['lm_eval']:.0f} "
          f"(server start included), ours {seconds['ours']:.0f}")  # fmt: skip
    print(f"{'metric':<9} {'lm-eval':>8} {'ours':>8}  items agreeing")
    for metric in ("acc", "acc_norm"):
        agreeing = summary[f"items_agreeing_{metric}"]
        print(f"{metric:<9} {summary[metric]['lm_eval']:8.4f} {summary[metric]['ours']:8.4f}"
              f"  {agreeing}/{n}")  # fmt: skip
    gap_max = summary["max_abs_loglikelihood_difference"]
    gap_mean = summary["mean_abs_loglikelihood_difference"]
    print(f"choice log-likelihood |ours - lm-eval|: max {gap_max:.2e}, mean {gap_mean:.2e} nats")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": str(args.model), "task": TASK, "seconds": seconds, **summary,
        "per_item": {"ours": asdict(ours), "lm_eval": asdict(theirs)},
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
