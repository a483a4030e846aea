"""A megabyte of prompt must not stall the replica's event loop while it is tokenized: the
fuzz drill (benchmarks/drill/fuzz.py) saw a gateway take the replica for dead (its /ready
unanswered for seconds) and answer 503s to everyone."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from modelship.engine.outputs import EngineStats
from modelship.engine.tokenizer import Tokenizer
from modelship.server import protocol as p
from modelship.server.metrics import ServerMetrics
from modelship.server.openai_translation import OpenAIServing

MODEL = "tiny"
HUGE = "hello world " * 100_000  # 1.2 MB: a second or more of tokenizing


def no_stats() -> EngineStats:
    raise AssertionError("metrics are never scraped here")


class NoEngine:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer


@pytest.fixture(scope="module")
def serving(tiny_llama_dir: Path) -> OpenAIServing:
    engine = NoEngine(Tokenizer.from_folder(tiny_llama_dir))
    metrics = ServerMetrics(no_stats, MODEL, "base")
    return OpenAIServing(engine, MODEL, 256, metrics)


async def beats_while(work) -> tuple[object, int]:
    """`work`'s result, and how often another task ran on the loop meanwhile."""
    beats = 0
    done = False

    async def heartbeat() -> None:
        nonlocal beats
        while not done:
            beats += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)
    beats = 0
    try:
        result = await work
    finally:
        done = True
        await task
    return result, beats


def test_completion_prompts_are_tokenized_off_the_event_loop(serving: OpenAIServing) -> None:
    request = p.CompletionRequest(model=MODEL, prompt=["short", HUGE])
    prompts, beats = asyncio.run(beats_while(serving.completion_prompts(request)))
    assert beats > 10  # synchronous tokenizing: none
    assert prompts == [serving.tokenizer("short").input_ids, serving.tokenizer(HUGE).input_ids]


def test_one_thread_tokenizes(serving: OpenAIServing, monkeypatch) -> None:
    """Each thread that tokenized a megabyte prompt kept its own malloc arena at that peak
    (six of them: 1.2 GB of RSS); one thread keeps one."""
    threads = set()
    tokenizer = serving.tokenizer

    def recording(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return tokenizer(*args, **kwargs)

    monkeypatch.setattr(serving, "tokenizer", recording)

    async def many() -> None:
        requests = [p.CompletionRequest(model=MODEL, prompt=f"prompt {i}") for i in range(8)]
        await asyncio.gather(*(serving.encode([r.prompt]) for r in requests))

    asyncio.run(many())
    assert len(threads) == 1 and threads.pop().startswith("modelship-tokenize")


def test_chat_prompts_are_tokenized_off_the_event_loop(serving: OpenAIServing) -> None:
    if not serving.tokenizer.chat_template:
        pytest.skip("the tiny model has no chat template")
    message = p.ChatMessage(role="user", content=HUGE)
    request = p.ChatCompletionRequest(model=MODEL, messages=[message])
    prompt, beats = asyncio.run(beats_while(serving.chat_prompt(request)))
    assert beats > 10
    text = serving.tokenizer.apply_chat_template(
        [{"role": "user", "content": HUGE}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == serving.tokenizer(text, add_special_tokens=False).input_ids
