"""The fleet's canary judge over the evidence on storage (`fleet/stored_judge.py`): several
gateways' evidence files judged together; a new judge (the next leader) reaches the dead
one's verdict from storage alone; evidence of another canary run does not count."""

from __future__ import annotations

import json
from pathlib import Path

from modelship.fleet.canary_evidence import (
    CanaryEvidence,
    EvidenceLog,
    EvidenceReader,
    evidence_dir,
)
from modelship.fleet.stored_judge import StoredJudge, canary_run
from modelship.gateway.canary import Track
from modelship.gateway.config import CanaryJudgeConfig
from modelship.release.traffic import read_traffic, start_canary
from modelship.storage import Storage

from fleet_storage import placeholder_releases

SLUG = "tiny"
NOW = 1_800_000_000.0
CONFIG = CanaryJudgeConfig(min_requests=4, window_s=600)


def storage_with_canary(tmp_path: Path) -> Storage:
    storage = placeholder_releases(tmp_path, SLUG)
    start_canary(storage, SLUG, 2, 50)
    return storage


def write(log: EvidenceLog, run: str, track: Track, ok: bool, n: int, at: float = NOW) -> None:
    for i in range(n):
        log.append(CanaryEvidence(at + i, run, track, ok, None, "acme"))


def test_a_new_judge_reaches_the_verdict_from_every_writers_evidence(tmp_path: Path) -> None:
    storage = storage_with_canary(tmp_path)
    run = canary_run(read_traffic(storage, SLUG), 1)
    assert run is not None and run.startswith("2:50:")
    folder = evidence_dir(storage, SLUG)
    leader, other = EvidenceLog(folder, "gateway-a-1"), EvidenceLog(folder, "gateway-b-2")
    clock = [NOW + 10]
    first = StoredJudge(storage, SLUG, CONFIG, clock=lambda: clock[0])
    write(leader, run, Track.STABLE, True, 3)
    write(leader, run, Track.CANARY, False, 2)
    write(other, "2:50:another run", Track.CANARY, False, 5)  # not this run's
    verdict = first.tick()
    assert verdict is not None and not verdict.rollback
    assert verdict.canary.num_requests == 2

    # The leader dies; the other gateway's evidence completes the picture. A fresh judge
    # reads every file from the start of the window.
    write(other, run, Track.STABLE, True, 1)
    write(other, run, Track.CANARY, False, 2)
    rolled_back: list[int] = []
    second = StoredJudge(storage, SLUG, CONFIG, clock=lambda: clock[0],
                         on_rollback=lambda release, _: rolled_back.append(release))  # fmt: skip
    verdict = second.tick()
    assert verdict is not None and verdict.rollback
    assert (verdict.stable.num_requests, verdict.canary.num_requests) == (4, 4)
    plan = read_traffic(storage, SLUG)
    assert plan.canary is None and rolled_back == [2]
    event = plan.events[-1]
    assert event["action"] == "auto_rollback" and event["release"] == 2
    assert "canary: 4 requests, 100.0% errors" in event["reason"]
    assert second.tick() is None  # no canary runs any more
    leader.close()
    other.close()


def test_evidence_outside_the_window_is_not_judged(tmp_path: Path) -> None:
    storage = storage_with_canary(tmp_path)
    run = canary_run(read_traffic(storage, SLUG), 1)
    assert run is not None
    log = EvidenceLog(evidence_dir(storage, SLUG), "gateway-a-1")
    write(log, run, Track.STABLE, True, 4, at=NOW - 700)
    write(log, run, Track.CANARY, False, 4, at=NOW - 700)
    judge = StoredJudge(storage, SLUG, CONFIG, clock=lambda: NOW)
    verdict = judge.tick()
    assert verdict is not None and not verdict.rollback
    assert verdict.reason == "not enough requests yet"
    log.close()


def test_the_reader_leaves_an_unfinished_line_for_its_next_read(tmp_path: Path) -> None:
    folder = tmp_path / "canary"
    log = EvidenceLog(folder, "gateway-a-1")
    write(log, "r", Track.CANARY, True, 1)
    reader = EvidenceReader(folder, NOW - 60)
    assert len(reader.read_new()) == 1
    [path] = folder.iterdir()
    line = json.dumps({"at": NOW, "run": "r", "track": "stable", "ok": True, "ttft_s": 0.1})
    with open(path, "a") as file:
        file.write(line[:20])  # a write under way
    assert reader.read_new() == []
    with open(path, "a") as file:
        file.write(line[20:] + "\n")
    [evidence] = reader.read_new()
    assert evidence.track is Track.STABLE and evidence.ttft_s == 0.1
    assert reader.read_new() == []
    log.close()
