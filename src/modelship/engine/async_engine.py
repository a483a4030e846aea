"""`AsyncLLMEngine`: the engine loop on its own thread, requests as async iterators of deltas.

The model step is CPU/GPU-bound and blocks for milliseconds, so it runs on a dedicated
thread; the asyncio side only exchanges small messages with it. `add_request` is resolved
by the engine thread at the start of its next step, so admission errors
(`EngineOverloadedError`, `RequestTooLongError`) are raised to the caller, and a request
id is either in the engine or was never added.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from modelship.engine.config import EngineConfig
from modelship.engine.llm_engine import LLMEngine
from modelship.engine.outputs import EngineStats, SequenceDelta
from modelship.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    deliver: Callable[[SequenceDelta | BaseException], None]
    accepted: Future
    cache_salt: str | None = None


@dataclass
class _Abort:
    request_id: str


class AsyncLLMEngine:
    """Async front of one `LLMEngine`, safe to call from one event loop."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[SequenceDelta | BaseException], None]] = {}
        self._unfinished: dict[str, int] = {}  # request id -> sequences not finished yet
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="modelship-engine", daemon=True)
        self._stopped = threading.Event()
        self._thread.start()

    @classmethod
    def from_model(cls, model_path: str | Path, config: EngineConfig | None = None):
        return cls(LLMEngine(model_path, config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """The snapshot taken after the last step (running, waiting, KV usage, ...)."""
        return self._stats

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[SequenceDelta]:
        """Admit a request and return an iterator over its deltas (ends when all finish).

        Raises the engine's admission errors here. Closing the iterator early (e.g. the
        client went away) aborts the request and frees its blocks.
        """
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[SequenceDelta | BaseException] = asyncio.Queue()

        def deliver(item: SequenceDelta | BaseException) -> None:
            loop.call_soon_threadsafe(deltas.put_nowait, item)

        accepted: Future = Future()
        add = _Add(request_id, prompt, params, priority, deliver, accepted, cache_salt)
        self._inbox.put(add)
        await asyncio.wrap_future(accepted)  # raises the admission error, if any
        return self._stream(request_id, params.n, deltas)

    async def _stream(
        self, request_id: str, n: int, deltas: asyncio.Queue[SequenceDelta | BaseException]
    ) -> AsyncIterator[SequenceDelta]:
        remaining = n
        try:
            while remaining:
                item = await deltas.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield item
        finally:
            if remaining:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._stopped.wait(timeout=30)

    # Engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished()
                if not self._drain_inbox(block):
                    return
                if not self.engine.has_unfinished():
                    continue
                try:
                    deltas = self.engine.step()
                except Exception as exc:  # a failed step must not leave callers waiting
                    logger.exception("engine step failed")
                    self._fail_all(exc)
                    continue
                self._stats = self.engine.stats()
                for delta in deltas:
                    self._dispatch(delta)
        finally:
            self._stopped.set()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds and aborts; False when asked to stop."""
        while True:
            try:
                message = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if message is None:
                self._fail_all(RuntimeError("the engine was shut down"))
                return False
            if isinstance(message, _Abort):
                for delta in self.engine.abort(message.request_id):
                    self._dispatch(delta)
                self._stats = self.engine.stats()
                continue
            try:
                self.engine.add_request(
                    message.request_id,
                    message.prompt,
                    message.params,
                    message.priority,
                    message.cache_salt,
                )
            except Exception as exc:
                message.accepted.set_exception(exc)
                continue
            self._sinks[message.request_id] = message.deliver
            self._unfinished[message.request_id] = message.params.n
            message.accepted.set_result(None)
            self._stats = self.engine.stats()

    def _dispatch(self, delta: SequenceDelta) -> None:
        sink = self._sinks.get(delta.request_id)
        if sink is None:
            return
        sink(delta)
        if delta.finished:
            # Deltas of one step are dispatched after the step, so the engine may already
            # have forgotten the request; count finished sequences here instead.
            self._unfinished[delta.request_id] -= 1
            if self._unfinished[delta.request_id] == 0:
                self._sinks.pop(delta.request_id, None)
                del self._unfinished[delta.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, sink in list(self._sinks.items()):
            self.engine.abort(request_id)
            sink(exc)
        self._sinks.clear()
        self._unfinished.clear()
