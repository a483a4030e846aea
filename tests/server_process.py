"""Start `modelship serve` as a real subprocess on 127.0.0.1 and wait until it is ready."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from modelship.server.process import ReplicaProcess


class ServerProcess(ReplicaProcess):
    def __init__(
        self, model_dir: Path, *args: str, timeout_s: float = 120.0, api_key: str | None = None
    ) -> None:
        name = f"modelship-serve-{uuid.uuid4().hex[:8]}.log"
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / name
        super().__init__(model_dir, *args, log_path=log_path, api_key=api_key)
        self.wait_ready(timeout_s)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()
