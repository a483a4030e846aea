"""`EngineClient`: what the server needs of an engine, whichever front runs it.

Two fronts satisfy it: `AsyncLLMEngine` (the engine loop on a thread of the server's
process) and `EngineCoreClient` (the engine in a child process, over a pipe). The server
is written against this Protocol only, so either front serves the same routes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from modelship.engine.outputs import EngineStats, SequenceDelta
from modelship.engine.request import EngineRequest


class EngineClient(Protocol):
    """Called from one event loop. Once `is_dead` turns true it stays true, and every
    call that admits work raises `EngineDeadError`."""

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (called on text, `.decode` on ids), usable in this process."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def is_dead(self) -> bool:
        """True once the engine has stopped (an error or shutdown); never false again."""
        ...

    @property
    def stalled_s(self) -> float:
        """How long the engine has shown no progress while it has work (0 when it is
        idle or between steps): a large value means a wedged step."""
        ...

    def stats(self) -> EngineStats:
        """The snapshot after the last step; does not wait for the engine."""
        ...

    async def add_request(self, request: EngineRequest) -> AsyncIterator[SequenceDelta]:
        """Admit `request` and return an iterator over its deltas, which ends when its
        `params.n` sequences have finished. Admission errors (`EngineOverloadedError`,
        `RequestTooLongError`, `InvalidParamsError`, `ValueError`, `KeyError` for an
        adapter the engine does not hold, `EngineDeadError`) are raised here, and then the
        engine holds nothing of the request. Closing the iterator early, or cancelling
        this call, aborts the request and frees its blocks."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; a no-op for an id the engine does not hold."""
        ...

    async def load_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter between two steps; raises `LoRAError` (a ValueError) for a
        folder that is not a usable adapter, and then the engine is unchanged."""
        ...

    async def unload_lora(self, name: str) -> None:
        """Forget an adapter (KeyError if unknown); running requests keep its weights."""
        ...

    def lora_names(self) -> list[str]: ...

    def shutdown(self) -> None:
        """Stop the engine and wait for it; open requests fail with `EngineDeadError`."""
        ...
