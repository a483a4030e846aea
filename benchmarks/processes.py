"""Helpers the benchmarks share for the servers they start."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until `url`/ready answers 200; exits the benchmark if `process` dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: the process exited ({process.returncode})")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} was not ready within {timeout_s} s")
