"""Children that die with their parent: replicas, select's server, optimize's pool workers.

Linux's PR_SET_PDEATHSIG delivers a signal to a child when its parent dies, even by
kill -9, so a crashed supervisor or `modelship run` leaves no orphan holding a port, a
lock or memory. It fires when the *thread* that forked the child exits: fork from a thread
that outlives the child. It is set from inside the child, so a parent that dies between
the fork and the `prctl` would be missed; both functions check for that afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: signal.Signals = signal.SIGTERM) -> None:
    """Called in the child: get `sig` when the process `parent_pid` (our parent) dies; if
    it is already gone, get it now."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: no such guarantee
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def parent_death_signal(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """A `subprocess.Popen(preexec_fn=...)` that calls `die_with_parent` for the caller."""
    parent_pid = os.getpid()
    return lambda: die_with_parent(parent_pid, sig)
