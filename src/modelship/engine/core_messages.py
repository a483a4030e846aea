"""The messages of the engine core's two pipes (`engine/core.py`), pickled dataclasses.

client -> core: `CoreStart` first, then `EngineRequest` (admit), `AbortRequest`,
`LoRACall`, and `None` (shut down).
core -> client: `CoreReady` once the model is loaded, then one `CoreStepOutput` per loop
turn that has news; `CoreDead` before the core exits on an internal error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelship.engine.config import EngineConfig
from modelship.engine.errors import EngineOverloadedError, RequestTooLongError
from modelship.engine.outputs import EngineStats, SequenceDelta
from modelship.engine.sampling_params import InvalidParamsError


@dataclass(frozen=True)
class CoreStart:
    """The core's first message: the model to load and how."""

    model_path: Path
    config: EngineConfig


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class LoRACall:
    """Load or unload an adapter between two steps, acked like an admission."""

    call_id: str  # never a request id
    method: str  # "load_lora" | "unload_lora"
    args: tuple[str, ...]


@dataclass(frozen=True)
class WireError:
    """An admission error as it crosses the pipe: the exception classes take other
    constructor arguments than they keep in `args`, so they do not unpickle as such."""

    kind: str  # key | overloaded | params | too_long | value | internal
    message: str
    detail: Any = None

    @classmethod
    def from_exception(cls, exc: Exception) -> WireError:
        if isinstance(exc, KeyError):  # an unknown adapter (a LoRAError is a ValueError)
            return cls("key", str(exc.args[0]) if exc.args else "")
        if isinstance(exc, EngineOverloadedError):
            return cls("overloaded", exc.reason, exc.retry_after_s)
        if isinstance(exc, InvalidParamsError):
            return cls("params", str(exc), exc.param)
        if isinstance(exc, RequestTooLongError):
            return cls("too_long", str(exc))
        if isinstance(exc, ValueError):
            return cls("value", str(exc))
        return cls("internal", f"{type(exc).__name__}: {exc}")

    def to_exception(self) -> Exception:
        if self.kind == "key":
            return KeyError(self.message)
        if self.kind == "overloaded":
            return EngineOverloadedError(self.message, self.detail)
        if self.kind == "params":
            return InvalidParamsError(self.detail, self.message)
        if self.kind == "too_long":
            return RequestTooLongError(self.message)
        if self.kind == "value":
            return ValueError(self.message)
        return RuntimeError(self.message)


@dataclass(frozen=True)
class Admission:
    """The answer to an `EngineRequest` (by its request id) or a `LoRACall` (its call id):
    `error` None means it was taken."""

    call_id: str
    error: WireError | None = None


@dataclass(frozen=True)
class CoreReady:
    pass


@dataclass(frozen=True)
class CoreStepOutput:
    """One loop turn of the core: the admissions it answered, the deltas of its step (and
    of aborts) and the stats after it. A step without deltas still says "alive"."""

    admissions: list[Admission]
    deltas: list[SequenceDelta]
    stats: EngineStats


@dataclass(frozen=True)
class CoreDead:
    message: str
