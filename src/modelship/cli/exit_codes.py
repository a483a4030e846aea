"""Exit codes of every `modelship` command: this table is the one definition (README cites it).

    code  name        meaning                                          what to do
    0     OK          done (`serve`/`up`/`gateway`: drained and stopped after SIGTERM/SIGINT)
    1     FAILURE     the job could not be done: a missing model, a   read the one-line
                      folder that is no model, nothing to select from, message: it names
                      a failed check, a replica whose engine died      the fix
    2     USAGE       bad configuration or usage: a broken             fix the named flag or
                      pipeline.yaml, an unknown or impossible option,  field, then run again
                      a device this torch cannot use
    3     STARTUP     `serve` could not start after the model loaded   the log's last lines
                      (the warm-up step raised)                        name the cause
    98    PORT_IN_USE `serve`'s address is taken or cannot be bound    free the port or pass
                      (checked before the model loads)                 another --port
    75    TRANSIENT   worth retrying as is (EX_TEMPFAIL): the Hub is   retry; the Argo Workflow
                      unreachable, a worker was killed                 retries it by itself

Every error is printed as `error: <problem> (<the fix>)` on stderr, one line, no traceback.
Click's own usage errors (an unknown flag, a missing argument) also exit 2.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1
    USAGE = 2
    STARTUP = 3
    TRANSIENT = 75
    PORT_IN_USE = 98  # EADDRINUSE's errno on Linux
