"""Quality of a variant, measured with our engine's own model (the numerics it serves with).

All measurements are teacher-forced: token sequences go through the model in one packed
batch and every position's next-token distribution is read, as lm-eval's loglikelihood
requests do. Against the base model, on held-out text never used for calibration:
perplexity, top-1 agreement and KL(base || variant) per token. On the task set written
in this repo (`tasks.jsonl`): multiple choice by the summed logprob of each choice, and
exact match by whether greedy decoding reproduces the answer token by token. Tool-call
success is generated, not teacher-forced (`tool_use.py`). Each item's own numbers are kept
(`QualityItems`) for the bootstrap intervals of `intervals.py`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from modelship.engine import EngineConfig, LLMEngine
from modelship.model.config import ModelConfig
from modelship.model.kv_cache import kv_cache_bytes_per_block
from modelship.model.loader import resolve_dtype
from modelship.pipeline.select.benchmark_data import ChoiceItem
from modelship.pipeline.select.multiple_choice import score_choices
from modelship.pipeline.select.tool_use import ToolTask, score_tool_calls

TASKS_PATH = Path(__file__).with_name("tasks.jsonl")


@dataclass(frozen=True)
class TaskItem:
    id: str
    kind: str  # "choice" or "exact"
    prompt: str
    choices: tuple[str, ...] = ()
    answer: int | str = 0


def load_tasks(path: Path = TASKS_PATH) -> list[TaskItem]:
    items = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        data = json.loads(line)
        item = TaskItem(
            id=data["id"],
            kind=data["kind"],
            prompt=data["prompt"],
            choices=tuple(data.get("choices", ())),
            answer=data["answer"],
        )
        if item.kind not in ("choice", "exact"):
            raise ValueError(f"{path}:{number}: kind must be 'choice' or 'exact'")
        items.append(item)
    return items


# Scoring batches as many sequences as the KV cache holds: this much at least, for speed.
MIN_KV_CACHE_BYTES = 64 * 1024**2


class Scorer:
    """A variant loaded in our engine, scoring token sequences with no sampling. Its KV
    cache holds one `max_model_len` sequence of this model (the engine refuses less: a
    float32 cache of the 135M demo model needs 90 MiB for 2048 tokens), and no less than
    MIN_KV_CACHE_BYTES. `lm_head`: the output head's numerics (`EngineConfig.lm_head`), as
    the variant is served."""

    def __init__(self, model_dir: Path, max_model_len: int = 2048, lm_head: str = "auto") -> None:
        config = EngineConfig(max_model_len=max_model_len, lm_head=lm_head)
        one_sequence = kv_cache_bytes(model_dir, config, max_model_len)
        config = replace(config, kv_cache_memory_bytes=max(MIN_KV_CACHE_BYTES, one_sequence))
        self.engine = LLMEngine(model_dir, config)
        self.tokenizer = self.engine.tokenizer

    def weight_bytes(self) -> int:
        return self.engine.weight_bytes()

    def logprobs(self, sequences: list[list[int]]) -> Iterator[torch.Tensor]:
        """For each sequence, [len - 1, vocab] float32 log-softmax of the next token."""
        return self.engine.score(sequences)


def kv_cache_bytes(model_dir: Path, config: EngineConfig, num_tokens: int) -> int:
    """Bytes of KV cache that `num_tokens` tokens of this model take under `config` (the
    cache dtype that its device and compute dtype give), in whole blocks."""
    model_config = ModelConfig.from_dir(model_dir)
    compute_dtype = resolve_dtype(model_config, config.torch_device, config.dtype)
    cache_dtype = config.cache_dtype(compute_dtype)
    block_bytes = kv_cache_bytes_per_block(model_config, config.block_size, cache_dtype)
    return block_bytes * -(-num_tokens // config.block_size)


@dataclass
class QualityItems:
    """Each item's own numbers, what the paired bootstrap (`intervals.py`) resamples: per
    held-out passage its summed nats, tokens, top-1 agreements and KL; per task item and
    per tool request whether the variant got it right; per item of the standard
    multiple-choice set (when configured) acc, acc_norm and the answer's probability."""

    passage_nll: list[float]
    passage_tokens: list[int]
    passage_agree: list[int]
    passage_kl: list[float]
    task_correct: list[bool]
    tool_correct: list[bool]
    benchmark_correct: list[bool] = field(default_factory=list)
    benchmark_correct_norm: list[bool] = field(default_factory=list)
    benchmark_choice_prob: list[float] = field(default_factory=list)


@dataclass
class QualityResult:
    perplexity: float
    top1_agreement: float  # share of positions where argmax equals the base's
    kl_divergence: float  # mean KL(base || variant) per token, nats
    task_accuracy: float
    task_accuracy_by_kind: dict[str, float]
    num_eval_tokens: int
    num_task_items: int
    tool_call_success: float | None = None  # share of `tool_use` tasks called right
    num_tool_tasks: int = 0
    items: QualityItems | None = None

    def to_dict(self) -> dict:
        return {**self.__dict__, "items": None if self.items is None else asdict(self.items)}


class Reference:
    """The base model's next-token distributions on the eval chunks, kept in bfloat16."""

    def __init__(self, chunks: list[list[int]], logprobs: list[torch.Tensor]) -> None:
        self.chunks = chunks
        self.logprobs = [lp.to(torch.bfloat16) for lp in logprobs]


def eval_chunks(tokenizer, texts: list[str], count: int, length: int) -> list[list[int]]:
    """`count` chunks of `length` tokens spread evenly over the held-out text."""
    ids = tokenizer("\n\n".join(texts)).input_ids
    if len(ids) < count * length:
        raise ValueError(f"held-out text has {len(ids)} tokens, {count}x{length} asked")
    stride = (len(ids) - length) // max(count - 1, 1)
    return [ids[i * stride : i * stride + length] for i in range(count)]


def make_reference(scorer: Scorer, chunks: list[list[int]]) -> Reference:
    return Reference(chunks, list(scorer.logprobs(chunks)))


def measure_quality(
    scorer: Scorer,
    reference: Reference,
    tasks: list[TaskItem],
    tool_tasks: list[ToolTask] | None = None,
    benchmark: list[ChoiceItem] | None = None,
) -> QualityResult:
    items = QualityItems([], [], [], [], [], [])
    for chunk, base_lp, lp in zip(
        reference.chunks, reference.logprobs, scorer.logprobs(reference.chunks), strict=True
    ):
        targets = torch.tensor(chunk[1:])
        base = base_lp.float()
        items.passage_nll.append(-lp.gather(1, targets[:, None]).sum().item())
        items.passage_tokens.append(len(targets))
        items.passage_agree.append(int((lp.argmax(-1) == base.argmax(-1)).sum().item()))
        items.passage_kl.append((base.exp() * (base - lp)).sum().item())
    nll, agree = sum(items.passage_nll), sum(items.passage_agree)
    kl, count = sum(items.passage_kl), sum(items.passage_tokens)
    correct: dict[str, list[bool]] = {}
    items.task_correct = score_tasks(scorer, tasks)
    for item, ok in zip(tasks, items.task_correct, strict=True):
        correct.setdefault(item.kind, []).append(ok)
    all_ok = items.task_correct
    called = score_tool_calls(scorer.engine, tool_tasks) if tool_tasks else []
    items.tool_correct = called
    for score in score_choices(scorer, benchmark) if benchmark else []:
        items.benchmark_correct.append(score.correct)
        items.benchmark_correct_norm.append(score.correct_norm)
        items.benchmark_choice_prob.append(score.choice_prob)
    return QualityResult(
        perplexity=math.exp(nll / count) if nll / count < 700 else math.inf,
        top1_agreement=agree / count,
        kl_divergence=max(kl / count, 0.0),
        task_accuracy=sum(all_ok) / len(all_ok) if all_ok else 0.0,
        task_accuracy_by_kind={k: sum(v) / len(v) for k, v in correct.items()},
        num_eval_tokens=count,
        num_task_items=len(all_ok),
        tool_call_success=sum(called) / len(called) if called else None,
        num_tool_tasks=len(called),
        items=items,
    )


def score_tasks(scorer: Scorer, tasks: list[TaskItem]) -> list[bool]:
    """Whether the model gets each item right (see the module docstring)."""
    tokenizer = scorer.tokenizer
    sequences: list[list[int]] = []
    spans: list[tuple[int, list[int]]] = []  # (context length, continuation ids)
    for item in tasks:
        context = tokenizer(item.prompt).input_ids
        continuations = item.choices if item.kind == "choice" else (str(item.answer),)
        for text in continuations:
            cont = tokenizer(text, add_special_tokens=False).input_ids
            sequences.append(context + cont)
            spans.append((len(context), cont))
    scores: list[tuple[float, bool]] = []
    for (context_len, cont), lp in zip(spans, scorer.logprobs(sequences), strict=True):
        rows = lp[context_len - 1 : context_len - 1 + len(cont)]
        targets = torch.tensor(cont)
        logprob = rows.gather(1, targets[:, None]).sum().item()
        greedy = bool((rows.argmax(-1) == targets).all())
        scores.append((logprob, greedy))
    results, i = [], 0
    for item in tasks:
        if item.kind == "choice":
            options = scores[i : i + len(item.choices)]
            best = max(range(len(options)), key=lambda k: options[k][0])
            results.append(best == item.answer)
            i += len(item.choices)
        else:
            results.append(scores[i][1])
            i += 1
    return results
