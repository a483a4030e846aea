"""Children die with their parent: the `prctl` path and the parent-already-gone path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil


def test_a_child_whose_parent_is_already_gone_kills_itself() -> None:
    """The race `die_with_parent` closes: the parent died between fork and prctl (here the
    child is told of a parent it does not have)."""
    code = "from modelship.lifetime import die_with_parent; die_with_parent(1); print('alive')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM
    assert "alive" not in done.stdout


def test_optimize_pool_workers_die_with_a_killed_run() -> None:
    """kill -9 of the process that owns optimize's pool takes the workers with it: an
    orphaned worker used to hold a variant's lock and publish it after the run was gone."""
    code = textwrap.dedent(
        """
        import multiprocessing, os, time
        from concurrent.futures import ProcessPoolExecutor
        from modelship.pipeline.optimize.runner import _worker_init

        if __name__ == "__main__":
            context = multiprocessing.get_context("spawn")
            pool = ProcessPoolExecutor(2, mp_context=context, initializer=_worker_init,
                                       initargs=(os.getpid(), None))
            pool.submit(time.sleep, 300)
            pool.submit(os.getpid).result()
            print("ready", flush=True)
            time.sleep(300)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        workers = [
            p
            for p in psutil.Process(parent.pid).children()
            if "spawn_main" in " ".join(p.cmdline())
        ]
        assert len(workers) == 2
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"orphaned pool workers: {[p.pid for p in alive]}"
    finally:
        parent.kill()
