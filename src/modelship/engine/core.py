"""The engine core in its own process, and the async client the server talks to.

vLLM v1's EngineCore shape: the core process runs only schedule -> execute -> sample
(and the incremental detokenizer, which stop strings need) in a tight loop; the HTTP
process parses, tokenizes, streams SSE and keeps metrics. They share no interpreter, so
the event loop never waits for the GIL in the middle of a step, and a step never waits
for the event loop.

Wire (two pipes, `multiprocessing.connection` framing, the pickled dataclasses of
`core_messages.py`):
- client -> core: `CoreStart` (model path and `EngineConfig`) first, then `EngineRequest`
  (admit), `AbortRequest`, `LoRACall` (load or unload an adapter, acked like an
  admission), `None` (shut down).
- core -> client: `CoreReady` once the model is loaded, then one `CoreStepOutput` per
  loop turn that has news (the `Admission` answers, the deltas, the stats); `CoreDead`
  before the core exits on an internal error.

A core that dies (an error, kill -9, out of memory) closes its pipe: the client fails
every open request with `EngineDeadError`, refuses new ones and calls `on_death`, so the
server exits non-zero and its supervisor starts a new replica. A client that dies closes
the core's input pipe and the core exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from pathlib import Path

from modelship.engine.async_engine import stream_deltas
from modelship.engine.config import EngineConfig
from modelship.engine.core_messages import (
    AbortRequest,
    Admission,
    CoreDead,
    CoreReady,
    CoreStart,
    CoreStepOutput,
    LoRACall,
    WireError,
)
from modelship.engine.errors import EngineDeadError
from modelship.engine.faults import REPLICA_PID_ENV
from modelship.engine.outputs import EngineStats, SequenceDelta
from modelship.engine.request import EngineRequest
from modelship.engine.tokenizer import load_tokenizer
from modelship.lifetime import die_with_parent

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 600.0  # a model load slower than this is a hung core
_F_SETPIPE_SZ = 1031  # Linux fcntl command


# Core process ------------------------------------------------------------------------------
class EngineCore:
    """The loop of the core process: drain the inbox, step, send one message per turn."""

    def __init__(self, engine, inbox: Connection, outbox: Connection) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox

    def run(self) -> None:
        """Returns when told to shut down or when the client has gone (its pipe closed)."""
        engine = self.engine
        while True:
            if not engine.has_unfinished():
                self.inbox.poll(None)  # idle: sleep until a message (or EOF) arrives
            admissions: list[Admission] = []
            deltas: list[SequenceDelta] = []
            while self.inbox.poll():
                try:
                    message = self.inbox.recv()
                except EOFError:
                    return
                if message is None:
                    return
                self._apply(message, admissions, deltas)
            stepped = engine.has_unfinished()
            if stepped:
                deltas.extend(engine.step())
            if admissions or deltas or stepped:  # a step without deltas still says "alive"
                self.outbox.send(CoreStepOutput(admissions, deltas, engine.stats()))

    def _apply(
        self,
        message: EngineRequest | AbortRequest | LoRACall,
        admissions: list[Admission],
        deltas: list[SequenceDelta],
    ) -> None:
        if isinstance(message, AbortRequest):
            deltas.extend(self.engine.abort(message.request_id))
            return
        call_id = message.call_id if isinstance(message, LoRACall) else message.request_id
        try:
            if isinstance(message, LoRACall):  # load_lora(name, path) / unload_lora(name)
                getattr(self.engine, message.method)(*message.args)
            else:
                self.engine.add(message)
        except Exception as exc:  # `add` is atomic; a bad adapter folder or name changes nothing
            admissions.append(Admission(call_id, WireError.from_exception(exc)))
            return
        admissions.append(Admission(call_id))


_CORE_MAIN = "import sys; from modelship.engine.core import main; sys.exit(main(sys.argv[1:]))"


def main(argv: list[str]) -> int:
    """The core process: `argv` is [IN_FD, OUT_FD], its ends of the two pipes."""
    in_fd, out_fd = (int(a) for a in argv)
    # Killed with the server, whatever it is doing: a closed pipe ends a core between steps,
    # but a core stuck in a step never reads it, and lived on as an orphan holding the
    # model's memory. The server creates its client on its main thread, which lives as long
    # as it does (the signal follows the forking thread).
    server_pid = os.environ.get(REPLICA_PID_ENV)
    if server_pid:
        die_with_parent(int(server_pid), signal.SIGKILL)
    # The client decides when the core stops (its `None`, or its pipe closing): a Ctrl-C
    # or SIGTERM sent to the whole process group must not kill the core while the server
    # drains its requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox = Connection(in_fd, writable=False)
    outbox = Connection(out_fd, readable=False)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s"
    )
    try:
        start: CoreStart = inbox.recv()
    except EOFError:
        return 0
    from modelship.engine.llm_engine import LLMEngine

    engine = None
    try:
        engine = LLMEngine(start.model_path, start.config)
        outbox.send(CoreReady())
        EngineCore(engine, inbox, outbox).run()
    except (BrokenPipeError, EOFError):  # the client has gone: nobody to report to
        return 0
    except BaseException as exc:
        logger.exception("the engine core died; the server fails its requests")
        with contextlib.suppress(OSError):
            outbox.send(CoreDead(f"the engine stopped after an internal error: {exc!r}"))
        return 1
    finally:
        if engine is not None:
            engine.close()  # tensor-parallel workers
    return 0


# Client (the server's process) -------------------------------------------------------------
class _Stream:
    __slots__ = ("queue", "unsent")

    def __init__(self, n: int) -> None:
        self.queue: asyncio.Queue[SequenceDelta | BaseException] = asyncio.Queue()
        self.unsent = n  # sequences whose final delta has not arrived from the core


class EngineCoreClient:
    """`AsyncLLMEngine`'s interface over an engine core in a child process.

    Starts the core at once (it loads the model while this process goes on importing the
    server); the first `add_request` waits until the core is ready. Call from one event
    loop; `on_death` (if set) is called in that loop when the core has died."""

    def __init__(self, model_path: str | Path, config: EngineConfig | None = None) -> None:
        self.model_path = Path(model_path)
        self.config = config or EngineConfig()
        core_in, self._inbox_w = os.pipe()
        self._outbox_r, core_out = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-c", _CORE_MAIN, str(core_in), str(core_out)],
            pass_fds=(core_in, core_out),
            env={**os.environ, REPLICA_PID_ENV: str(os.getpid())},
        )
        os.close(core_in)
        os.close(core_out)
        for fd in (self._inbox_w, self._outbox_r):
            with contextlib.suppress(OSError):  # a bigger buffer: fewer stalls on a busy core
                fcntl.fcntl(fd, _F_SETPIPE_SZ, 1 << 20)
        self._to_core = Connection(self._inbox_w, readable=False)
        self._from_core = Connection(self._outbox_r, writable=False)
        self._to_core.send(CoreStart(self.model_path, self.config))
        self.tokenizer = load_tokenizer(self.model_path)
        self.on_death: Callable[[], None] | None = None
        self._stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)
        self._streams: dict[str, _Stream] = {}
        self._admissions: dict[str, asyncio.Future[None]] = {}
        self._ready: asyncio.Future[None] | None = None
        self._error: EngineDeadError | None = None
        self._crashed = False
        self._last_heard = time.monotonic()  # when the core last sent anything
        self._lora_names = [name for name, _ in self.config.loras]
        self._num_calls = 0

    @classmethod
    def from_model(cls, model_path: str | Path, config: EngineConfig | None = None):
        return cls(model_path, config)

    @property
    def pid(self) -> int:
        """The core process's pid."""
        return self._process.pid

    @property
    def max_model_len(self) -> int:
        from modelship.model.config import ModelConfig

        model_config = ModelConfig.from_dir(self.model_path)
        return self.config.max_model_len or model_config.max_position_embeddings

    def stats(self) -> EngineStats:
        """The snapshot the core sent after its last step."""
        return self._stats

    @property
    def is_dead(self) -> bool:
        """True once the core has stopped (died or shut down); never false again."""
        return self._error is not None

    @property
    def stalled_s(self) -> float:
        """Seconds the core has been silent while requests are open (0 when idle): it
        reports after every step, so a long silence means a wedged step."""
        if not self._streams and not self._admissions:
            return 0.0
        return time.monotonic() - self._last_heard

    @property
    def crashed(self) -> bool:
        """True if the core died rather than being shut down."""
        return self._crashed

    async def add_request(self, request: EngineRequest) -> AsyncIterator[SequenceDelta]:
        """As `AsyncLLMEngine.add_request`: admission errors are raised here."""
        await self._wait_ready()
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        request_id = request.request_id
        if request_id in self._admissions or request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        accepted = asyncio.get_running_loop().create_future()
        self._admissions[request_id] = accepted
        stream = _Stream(request.params.n)
        self._streams[request_id] = stream
        try:
            self._send(request)
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the core may have taken it: abort is a no-op if not
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finally:
            self._admissions.pop(request_id, None)
        return stream_deltas(stream.queue, request.params.n, lambda: self.abort(request_id))

    async def load_lora(self, name: str, path: str) -> None:
        """As `AsyncLLMEngine.load_lora`, in the core process."""
        await self._lora_call("load_lora", name, path)
        self._lora_names = [*[n for n in self._lora_names if n != name], name]

    async def unload_lora(self, name: str) -> None:
        await self._lora_call("unload_lora", name)
        self._lora_names = [n for n in self._lora_names if n != name]

    def lora_names(self) -> list[str]:
        return list(self._lora_names)

    async def _lora_call(self, method: str, *args: str) -> None:
        await self._wait_ready()
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        self._num_calls += 1
        call_id = f"lora-call-{self._num_calls}"  # acked like an add, never a request id
        done = asyncio.get_running_loop().create_future()
        self._admissions[call_id] = done
        try:
            self._send(LoRACall(call_id, method, args))
            await done
        finally:
            self._admissions.pop(call_id, None)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self._error is None:
            self._send(AbortRequest(request_id))

    def shutdown(self) -> None:
        """Ask the core to stop and wait for it (kill it after 30 s)."""
        with contextlib.suppress(OSError):
            self._to_core.send(None)
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._detach()
        self._fail(EngineDeadError("the engine was shut down"), notify=False)

    # Messages from the core ------------------------------------------------------------------
    async def _wait_ready(self) -> None:
        if self._ready is None:
            loop = asyncio.get_running_loop()
            self._ready = loop.create_future()
            loop.add_reader(self._outbox_r, self._on_readable)
        await asyncio.wait_for(asyncio.shield(self._ready), _READY_TIMEOUT_S)

    def _send(self, message: EngineRequest | AbortRequest | LoRACall) -> None:
        try:
            self._to_core.send(message)
        except OSError as exc:  # the core has gone; its EOF fails the requests
            raise EngineDeadError(f"the engine core has gone: {exc}") from exc

    def _on_readable(self) -> None:
        try:
            while self._from_core.poll():
                self._handle(self._from_core.recv())
        except (EOFError, OSError):
            code = self._process.poll()
            self._fail(EngineDeadError(f"the engine core exited (code {code})"))

    def _handle(self, message: CoreStepOutput | CoreReady | CoreDead) -> None:
        self._last_heard = time.monotonic()
        if isinstance(message, CoreStepOutput):
            self._stats = message.stats
            for admission in message.admissions:
                future = self._admissions.get(admission.call_id)
                if future is None or future.done():
                    continue
                if admission.error is None:
                    future.set_result(None)
                else:
                    future.set_exception(admission.error.to_exception())
            for delta in message.deltas:
                stream = self._streams.get(delta.request_id)
                if stream is None:
                    continue
                stream.queue.put_nowait(delta)
                if delta.finished:
                    stream.unsent -= 1
                    if not stream.unsent:  # its last sequence: nothing more will come
                        del self._streams[delta.request_id]
        elif isinstance(message, CoreReady):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif isinstance(message, CoreDead):
            self._fail(EngineDeadError(message.message))

    def _fail(self, error: EngineDeadError, notify: bool = True) -> None:
        if self._error is not None:
            return
        self._error = error
        self._crashed = notify
        self._detach()
        if notify or self._streams:
            logger.error("%s; failing %d open requests", error, len(self._streams))
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)  # add_request then raises the error
        for future in self._admissions.values():
            if not future.done():
                future.set_exception(EngineDeadError(str(error)))
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(str(error)))
        self._streams.clear()
        if notify and self.on_death is not None:
            self.on_death()

    def _detach(self) -> None:
        if self._ready is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._outbox_r)
