"""The canary judge's evidence on the shared storage: what every gateway replica saw.

Each gateway that follows a release plan appends one line per replica result to
`models/<slug>/fleet/canary/<UTC date>.<writer>.jsonl` while a canary runs (a file per
writer, as the usage ledger does: appends from several machines to one file can interleave
or be lost on network filesystems; a writer's own file cannot). Each line is written whole
with one `write`, so a reader sees whole lines, plus at most one unfinished last line it
leaves for its next read.

The elected leader reads every writer's file (`EvidenceReader`, from where it stopped) and
judges the union (`stored_judge.py`); a leader that dies loses nothing: the next one reads
the same files from the start of the judge's window.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from modelship.gateway.canary import Track
from modelship.storage import Storage

logger = logging.getLogger(__name__)

EVIDENCE_DIR = "canary"  # under models/<slug>/fleet/


@dataclass(frozen=True)
class CanaryEvidence:
    """One replica result on `track` during the canary run `run` (`stored_judge.canary_run`)."""

    at: float  # wall-clock seconds (time.time()) when it finished
    run: str
    track: Track
    ok: bool
    ttft_s: float | None  # a stream's `judged_ttft`; None otherwise
    tenant: str = ""

    @classmethod
    def from_json(cls, data: dict) -> CanaryEvidence:
        return cls(float(data["at"]), str(data["run"]), Track(data["track"]), bool(data["ok"]),
                   data.get("ttft_s"), str(data.get("tenant", "")))  # fmt: skip


def evidence_dir(storage: Storage, slug: str) -> Path:
    return storage.model_dir(slug) / "fleet" / EVIDENCE_DIR


def _day(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).date().isoformat()


class EvidenceLog:
    """This gateway's evidence file(s): `folder/<UTC date>.<writer>.jsonl`."""

    def __init__(self, folder: Path, writer: str) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", writer):
            raise ValueError(f"an evidence writer's name is letters, digits, - and _: {writer!r}")
        self.folder = folder
        self.writer = writer
        self._day: str | None = None
        self._file: IO[str] | None = None

    def append(self, evidence: CanaryEvidence) -> None:
        day = _day(evidence.at)
        try:
            if day != self._day or self._file is None:
                self.close()
                self.folder.mkdir(parents=True, exist_ok=True)
                self._file = open(self.folder / f"{day}.{self.writer}.jsonl", "a", buffering=1)  # noqa: SIM115
                self._day = day
            self._file.write(json.dumps(asdict(evidence), separators=(",", ":")) + "\n")
        except OSError as exc:  # storage trouble must not fail requests: less evidence
            logger.warning("canary evidence %s: %s", self.folder, exc)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class EvidenceReader:
    """Reads every writer's evidence files of the days from `since` (wall-clock seconds) on,
    each from where the last `read_new` stopped; new files (a writer that started, a new
    day) are picked up as they appear."""

    def __init__(self, folder: Path, since: float) -> None:
        self.folder = folder
        self.first_day = _day(since)
        self._offsets: dict[Path, int] = {}

    def read_new(self) -> list[CanaryEvidence]:
        """The whole lines written since the last call, oldest first; a line that is not
        evidence is logged and skipped."""
        found: list[CanaryEvidence] = []
        try:
            paths = sorted(self.folder.glob("*.jsonl"))
        except OSError as exc:
            logger.warning("canary evidence %s unreadable: %s", self.folder, exc)
            return found
        for path in paths:
            if path.name[:10] < self.first_day:
                continue
            offset = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as file:
                    file.seek(offset)
                    data = file.read()
            except OSError as exc:
                logger.warning("canary evidence %s unreadable: %s", path, exc)
                continue
            whole = data[: data.rfind(b"\n") + 1]  # an unfinished last line: next time
            self._offsets[path] = offset + len(whole)
            for line in whole.splitlines():
                try:
                    found.append(CanaryEvidence.from_json(json.loads(line)))
                except (ValueError, KeyError, TypeError) as exc:
                    logger.warning("%s: a line that is not canary evidence (%s)", path, exc)
        found.sort(key=lambda evidence: evidence.at)
        return found
