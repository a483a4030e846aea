"""Whether a process that wrote a record on shared storage is still alive.

Records (a pipeline run's status.json, a running `up`'s serving.json) name the host and
pid of their writer. Only a process on this host can be checked; one on another host is
taken as alive, since nothing here can tell.
"""

from __future__ import annotations

import os
import socket


def alive_here(hostname: str | None, pid: int | None) -> bool:
    """False only when the writer ran on this host and its pid is gone."""
    if pid is None or hostname != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
