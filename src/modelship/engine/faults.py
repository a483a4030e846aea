"""Fault injection for the reliability drills: off unless `MODELSHIP_INJECT_FAULTS` is set.

`MODELSHIP_INJECT_FAULTS="raise=<token id>,wedge=<token id>,kill=<seed>/<n>"` (each part
optional): a request whose prompt contains the `raise` token fails while its sampled token
is being processed (inside the engine step, as a detokenizer or logprobs bug would), and
one that contains the `wedge` token stops the engine loop there for good (as a hung kernel
would). Drills send such prompts as token ids. A request sampled with seed `<seed>` kills
its replica (kill -9 of the server and its engine core) once it has generated `<n>` tokens
there: a seed leaves a greedy request's output as it is, so the failover tests compare the
stream that lost its replica with an uninterrupted run of the same prompt. Nothing else
reads the variable, and a production replica never has it set.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from modelship.engine.sampling_params import SamplingParams

FAULTS_ENV = "MODELSHIP_INJECT_FAULTS"
# Set by `EngineCoreClient` for its core process: the replica's server process, which a
# `kill` fault kills along with the core.
REPLICA_PID_ENV = "MODELSHIP_REPLICA_PID"


class InjectedFault(RuntimeError):
    """Raised for a prompt carrying the `raise` token."""


@dataclass(frozen=True)
class FaultInjection:
    raise_token: int | None = None
    wedge_token: int | None = None
    kill_seed: int | None = None
    kill_after: int = 0  # tokens generated on this replica

    @classmethod
    def from_env(cls) -> FaultInjection | None:
        spec = os.environ.get(FAULTS_ENV, "").strip()
        if not spec:
            return None
        tokens: dict[str, int] = {}
        kill: tuple[int, int] | None = None
        for part in spec.split(","):
            kind, _, value = (s.strip() for s in part.partition("="))
            seed, _, after = value.partition("/")
            if kind == "kill" and seed.isdigit() and after.isdigit():
                kill = int(seed), int(after)
            elif kind in ("raise", "wedge") and value.isdigit():
                tokens[kind] = int(value)
            else:
                raise ValueError(
                    f"{FAULTS_ENV}: {part!r}; expected raise=<id>, wedge=<id> or kill=<seed>/<n>"
                )
        kill_seed, kill_after = kill or (None, 0)
        return cls(tokens.get("raise"), tokens.get("wedge"), kill_seed, kill_after)

    def on_sampled(
        self, prompt_token_ids: list[int], params: SamplingParams, num_output_tokens: int
    ) -> None:
        """Called while processing one request's sampled token(s), `num_output_tokens`
        generated on this replica so far (these included)."""
        seed = self.kill_seed
        if seed is not None and params.seed == seed and num_output_tokens >= self.kill_after:
            time.sleep(0.5)  # the tokens before this one reach the client first
            replica_pid = int(os.environ.get(REPLICA_PID_ENV, os.getpid()))
            if replica_pid != os.getpid():
                os.kill(replica_pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.raise_token is not None and self.raise_token in prompt_token_ids:
            raise InjectedFault(f"injected fault (prompt holds token {self.raise_token})")
        if self.wedge_token is not None and self.wedge_token in prompt_token_ids:
            while True:  # a hung step: only the process's end stops it
                time.sleep(3600)
