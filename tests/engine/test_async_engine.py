"""`AsyncLLMEngine` in process: cancelled admissions and the death of the engine thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from modelship.engine import (
    AsyncLLMEngine,
    EngineConfig,
    EngineDeadError,
    EngineRequest,
    LLMEngine,
    SamplingParams,
)

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama_dir: Path):
    config = EngineConfig(dtype="float32", block_size=4, num_kv_blocks=128)
    engine = AsyncLLMEngine(LLMEngine(tiny_llama_dir, config))
    yield engine
    engine.shutdown()


def text_request(
    engine: AsyncLLMEngine, request_id: str, text: str, params: SamplingParams
) -> EngineRequest:
    return EngineRequest(request_id, engine.tokenizer(text).input_ids, params)


async def collect(engine: AsyncLLMEngine, request_id: str, params: SamplingParams) -> list:
    stream = await engine.add_request(
        text_request(engine, request_id, "The quick brown fox", params)
    )
    return [delta async for delta in stream]


def test_caller_cancelled_during_admission_leaves_the_engine_running(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that disconnects while its request is being admitted (the race of a server
    handler cancelled in `add_request`): the engine aborts that request and serves the next."""
    entered, release = threading.Event(), threading.Event()
    add = engine.engine.add

    def slow_add(request: EngineRequest) -> None:
        if request.request_id == "gone":
            entered.set()
            release.wait(30)
        add(request)

    monkeypatch.setattr(engine.engine, "add", slow_add)

    async def main() -> list:
        admission = asyncio.create_task(
            engine.add_request(text_request(engine, "gone", "Paged attention", LONG))
        )
        assert await asyncio.to_thread(entered.wait, 30)
        admission.cancel()  # the engine thread is inside add_request: too late to un-queue
        with pytest.raises(asyncio.CancelledError):
            await admission
        release.set()
        return await asyncio.wait_for(collect(engine, "next", SHORT), timeout=60)

    deltas = asyncio.run(main())
    assert [d.num_output_tokens for d in deltas if d.finished] == [3]
    assert not engine.is_dead
    assert not engine.engine.has_request("gone")  # aborted, not generating unread
    assert engine.stats().num_running == 0


def test_cancelled_before_the_engine_saw_it_is_never_added(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()
    step = engine.engine.step

    def blocking_step():
        entered.set()
        release.wait(30)
        return step()

    monkeypatch.setattr(engine.engine, "step", blocking_step)
    added: list[str] = []
    add = engine.engine.add

    def recording_add(request: EngineRequest) -> None:
        added.append(request.request_id)
        add(request)

    monkeypatch.setattr(engine.engine, "add", recording_add)

    async def main() -> list:
        busy = asyncio.create_task(collect(engine, "busy", SHORT))
        assert await asyncio.to_thread(entered.wait, 30)  # the engine thread is in a step
        admission = asyncio.create_task(
            engine.add_request(text_request(engine, "gone", "Paged attention", LONG))
        )
        await asyncio.sleep(0)  # queued behind the step
        admission.cancel()
        with pytest.raises(asyncio.CancelledError):
            await admission
        release.set()
        await busy
        return await asyncio.wait_for(collect(engine, "next", SHORT), timeout=60)

    deltas = asyncio.run(main())
    assert [d.num_output_tokens for d in deltas if d.finished] == [3]
    assert added == ["busy", "next"]
    assert not engine.is_dead


def test_engine_thread_death_fails_open_requests_and_refuses_new_ones(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    step = engine.engine.step

    def failing_step():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("boom")
        return step()

    monkeypatch.setattr(engine.engine, "step", failing_step)

    async def main() -> None:
        with pytest.raises(EngineDeadError, match="boom"):
            await asyncio.wait_for(collect(engine, "open", LONG), timeout=60)
        assert engine.is_dead
        with pytest.raises(EngineDeadError):  # at once, not after a timeout
            await asyncio.wait_for(
                engine.add_request(text_request(engine, "later", "x", SHORT)), timeout=5
            )

    asyncio.run(main())
