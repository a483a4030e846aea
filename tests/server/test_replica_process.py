"""Process hygiene of the replicas the code starts: the port is handed over bound, and a
measurement replica of `select` dies with its parent."""

from __future__ import annotations

import errno
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from modelship.server.process import ReplicaProcess

pytestmark = pytest.mark.timeout(180)

SERVE_ARGS = ["--max-model-len", "256", "--kv-cache-memory-mb", "16"]


def listening_ports(process: psutil.Process) -> set[int]:
    return {
        c.laddr.port for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN
    }


def test_the_port_is_held_from_the_start_and_the_replica_serves_on_it(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    replica = ReplicaProcess(tiny_llama_dir, *SERVE_ARGS, log_path=tmp_path / "serve.log")
    try:
        # Still loading the model, yet nobody else can take its port any more.
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", replica.port))
        assert taken.value.errno == errno.EADDRINUSE
        replica.wait_ready(120)
        child = psutil.Process(replica.pid)
        assert listening_ports(child) == {replica.port}
        assert "--port" not in child.cmdline()
    finally:
        assert replica.stop() == 0, replica.log_tail()


SELECT_PARENT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from transformers import AutoTokenizer
    from modelship.pipeline.select.serving_benchmark import Workload, measure_serving

    model_dir, log_dir = Path(sys.argv[1]), Path(sys.argv[2])
    workload = Workload(
        latency_requests=100000, concurrency=1, throughput_requests=1, prompt_tokens=16,
        output_tokens=64,
    )
    measure_serving(
        {"replica": model_dir}, AutoTokenizer.from_pretrained(model_dir),
        lambda _: sys.argv[3:], workload, log_dir=log_dir,
    )
    """
)


def test_a_measurement_replica_dies_when_select_is_killed(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    log_path = tmp_path / "replica-serve.log"  # measure_serving names it after the variant
    parent = subprocess.Popen(
        [sys.executable, "-c", SELECT_PARENT, str(tiny_llama_dir), str(tmp_path), *SERVE_ARGS]
    )
    replica = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and parent.poll() is None:
            children = psutil.Process(parent.pid).children()
            replica = next((c for c in children if "serve" in c.cmdline()), None)
            if replica is not None and listening_ports(replica):  # serving the measurement
                break
            time.sleep(0.2)
        assert parent.poll() is None, "the select stand-in exited early"
        assert replica is not None and listening_ports(replica), log_path.read_text()
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        _, alive = psutil.wait_procs([replica], timeout=60)
        assert not alive, "the measurement replica outlived select"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if replica is not None and replica.is_running():  # an orphan: do not leak it
            replica.kill()
