"""Fault injection for the reliability drills: off unless `MODELSHIP_INJECT_FAULTS` is set.

`MODELSHIP_INJECT_FAULTS="raise=<token id>,wedge=<token id>"` (either part optional): a
request whose prompt contains the `raise` token fails while its sampled token is being
processed (inside the engine step, as a detokenizer or logprobs bug would), and one that
contains the `wedge` token stops the engine loop there for good (as a hung kernel would).
Drills send such prompts as token ids. Nothing else reads the variable, and a production
replica never has it set.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

FAULTS_ENV = "MODELSHIP_INJECT_FAULTS"


class InjectedFault(RuntimeError):
    """Raised for a prompt carrying the `raise` token."""


@dataclass(frozen=True)
class FaultInjection:
    raise_token: int | None = None
    wedge_token: int | None = None

    @classmethod
    def from_env(cls) -> FaultInjection | None:
        spec = os.environ.get(FAULTS_ENV, "").strip()
        if not spec:
            return None
        tokens: dict[str, int] = {}
        for part in spec.split(","):
            kind, _, value = part.partition("=")
            if kind.strip() not in ("raise", "wedge") or not value.strip().isdigit():
                raise ValueError(f"{FAULTS_ENV}: {part!r}; expected raise=<id> or wedge=<id>")
            tokens[kind.strip()] = int(value)
        return cls(tokens.get("raise"), tokens.get("wedge"))

    def on_sampled(self, prompt_token_ids: list[int]) -> None:
        """Called while processing one request's sampled token."""
        if self.raise_token is not None and self.raise_token in prompt_token_ids:
            raise InjectedFault(f"injected fault (prompt holds token {self.raise_token})")
        if self.wedge_token is not None and self.wedge_token in prompt_token_ids:
            while True:  # a hung step: only the process's end stops it
                time.sleep(3600)
