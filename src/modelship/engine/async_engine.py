"""`AsyncLLMEngine`: the engine loop on its own thread, requests as async iterators of deltas.

The model step is CPU/GPU-bound and blocks for milliseconds, so it runs on a dedicated
thread; the asyncio side only exchanges small messages with it (an `EngineRequest` in,
deltas out). `add_request` is resolved by the engine thread at the start of its next
step, so admission errors (`EngineOverloadedError`, `RequestTooLongError`) are raised to
the caller, and a request id is either in the engine or was never added. A caller
cancelled while it waits for that answer aborts the request, whether or not the engine
took it.

Any unexpected exception on the engine thread (a failed step included: the KV cache and
scheduler may be half updated) stops the engine for good: every open request fails with
`EngineDeadError`, later `add_request` calls raise it at once, and `is_dead` turns true
so the server reports itself unhealthy and a supervisor restarts the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from modelship.engine.config import EngineConfig
from modelship.engine.errors import EngineDeadError, RequestFailedError
from modelship.engine.llm_engine import LLMEngine
from modelship.engine.outputs import EngineStats, SequenceDelta
from modelship.engine.request import EngineRequest

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request: EngineRequest
    deliver: Callable[[SequenceDelta | BaseException], None]
    accepted: Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _LoRACall:
    """Load or unload a LoRA adapter between two steps (`LLMEngine.load_lora` /
    `unload_lora`), answered through `done`."""

    method: str  # "load_lora" | "unload_lora"
    args: tuple
    done: Future


class AsyncLLMEngine:
    """Async front of one `LLMEngine`, safe to call from one event loop."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Add | _Abort | _LoRACall | None] = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[SequenceDelta | BaseException], None]] = {}
        self._unfinished: dict[str, int] = {}  # request id -> sequences not finished yet
        self._stats = engine.stats()
        # Set once by the engine thread when it stops; the lock orders it with `_inbox.put`
        # so that no message is queued after the thread drained the inbox for the last time.
        self._error: EngineDeadError | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="modelship-engine", daemon=True)
        self._stopped = threading.Event()
        self._step_started: float | None = None  # monotonic time; None between steps
        self._thread.start()

    @classmethod
    def from_model(cls, model_path: str | Path, config: EngineConfig | None = None):
        return cls(LLMEngine(model_path, config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        """The snapshot taken after the last step (running, waiting, KV usage, ...)."""
        return self._stats

    @property
    def stalled_s(self) -> float:
        """Seconds the step now running has taken (0 between steps): a step that never
        ends is a wedged engine."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def is_dead(self) -> bool:
        """True once the engine thread has stopped (an error or shutdown); never false again."""
        return self._error is not None

    async def add_request(self, request: EngineRequest) -> AsyncIterator[SequenceDelta]:
        """Admit a request and return an iterator over its deltas (ends when all finish).

        Raises the engine's admission errors here, and `EngineDeadError` once the engine
        has stopped. Closing the iterator early (e.g. the client went away) aborts the
        request and frees its blocks.
        """
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[SequenceDelta | BaseException] = asyncio.Queue()

        def deliver(item: SequenceDelta | BaseException) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                loop.call_soon_threadsafe(deltas.put_nowait, item)

        accepted: Future = Future()
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(str(self._error))
            self._inbox.put(_Add(request, deliver, accepted))
        try:
            await asyncio.wrap_future(accepted)  # raises the admission error, if any
        except asyncio.CancelledError:
            # The engine may have taken the request already (then the future could not be
            # cancelled); an abort of a request the engine never took does nothing.
            self.abort(request.request_id)
            raise
        return stream_deltas(deltas, request.params.n, lambda: self.abort(request.request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def load_lora(self, name: str, path: str) -> None:
        """Register and load a LoRA adapter between two steps (`LLMEngine.load_lora`):
        raises `LoRAError` for a folder that is not a usable adapter."""
        await self._lora_call("load_lora", name, path)

    async def unload_lora(self, name: str) -> None:
        """Forget an adapter (KeyError if unknown); running requests keep its weights."""
        await self._lora_call("unload_lora", name)

    def lora_names(self) -> list[str]:
        return self.engine.loras.names() if self.engine.loras is not None else []

    async def _lora_call(self, method: str, *args: str) -> None:
        done: Future = Future()
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(str(self._error))
            self._inbox.put(_LoRACall(method, args, done))
        await asyncio.wrap_future(done)

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._stopped.wait(timeout=30)

    # Engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished()
                if not self._drain_inbox(block):
                    self._stop(EngineDeadError("the engine was shut down"))
                    return
                if not self.engine.has_unfinished():
                    continue
                self._step_started = time.monotonic()
                deltas = self.engine.step()
                self._step_started = None
                self._stats = self.engine.stats()
                for delta in deltas:
                    self._dispatch(delta)
        except BaseException as exc:
            logger.exception("the engine thread died; failing every open request")
            error = EngineDeadError(f"the engine stopped after an internal error: {exc!r}")
            error.__cause__ = exc
            self._stop(error)
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
                return False
            if isinstance(message, _LoRACall):
                if message.done.set_running_or_notify_cancel():
                    try:
                        getattr(self.engine, message.method)(*message.args)
                    except Exception as exc:  # a bad folder or name: the engine is unchanged
                        message.done.set_exception(exc)
                    else:
                        message.done.set_result(None)
                continue
            if isinstance(message, _Abort):
                for delta in self.engine.abort(message.request_id):
                    self._dispatch(delta)
                self._stats = self.engine.stats()
                continue
            if not message.accepted.set_running_or_notify_cancel():
                continue  # the caller went away before the engine saw the request
            # From here on the future cannot be cancelled, so setting it cannot raise.
            request = message.request
            try:
                self.engine.add(request)
            except Exception as exc:  # the engine added nothing (`add` is atomic)
                message.accepted.set_exception(exc)
                continue
            self._sinks[request.request_id] = message.deliver
            self._unfinished[request.request_id] = request.params.n
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

    def _stop(self, error: EngineDeadError) -> None:
        """Refuse new requests, then fail the queued and the open ones with `error`. The
        engine itself is left alone: after an error its state is not trusted."""
        with self._lock:
            self._error = error
        while True:
            try:
                message = self._inbox.get(block=False)
            except queue.Empty:
                break
            if isinstance(message, _Add) and message.accepted.set_running_or_notify_cancel():
                message.accepted.set_exception(EngineDeadError(str(error)))
        for sink in self._sinks.values():
            sink(EngineDeadError(str(error)))
        self._sinks.clear()
        self._unfinished.clear()


async def stream_deltas(
    deltas: asyncio.Queue[SequenceDelta | BaseException], n: int, abort: Callable[[], None]
) -> AsyncIterator[SequenceDelta]:
    """One request's deltas from `deltas` until its `n` sequences finish; an exception put
    in the queue, or a delta with an error, is raised. Closed before that (the client went
    away), it calls `abort`."""
    remaining = n
    try:
        while remaining:
            item = await deltas.get()
            if isinstance(item, BaseException):
                raise item
            if item.error is not None:  # this request failed inside the step; others go on
                remaining -= 1
                raise RequestFailedError(item.error)
            if item.finished:
                remaining -= 1
            yield item
    finally:
        if remaining:
            abort()
