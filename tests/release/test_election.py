"""The leader lease on storage (`fleet/election.py`): the pure rule, and candidates
contending for one real lease file with a clock the test moves."""

from __future__ import annotations

import asyncio
from pathlib import Path

from modelship.fleet.election import (
    LeaderElection,
    LeaseRecord,
    StorageLease,
    lease_path,
    next_record,
)
from modelship.storage import Storage


def test_the_rule() -> None:
    taken = next_record(None, "a", now=100.0, duration_s=10)
    assert taken == LeaseRecord("a", 100.0, 110.0, 0)
    assert next_record(taken, "b", now=109.9, duration_s=10) is None  # not expired
    renewed = next_record(taken, "a", now=105.0, duration_s=10)
    assert renewed == LeaseRecord("a", 100.0, 115.0, 0)
    assert next_record(renewed, "b", now=115.0, duration_s=10) == LeaseRecord("b", 115.0, 125.0, 1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_two_candidates_one_holder_and_the_handover(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "storage")
    path = lease_path(storage, "tiny")
    clock = Clock()
    a = StorageLease(storage, path, "a", duration_s=10, clock=clock)
    b = StorageLease(storage, path, "b", duration_s=10, clock=clock)
    assert a.try_acquire() and not b.try_acquire()
    clock.now += 9
    assert a.try_acquire() and not b.try_acquire()  # renewed: b waits again
    clock.now += 9.5
    assert not b.try_acquire()
    clock.now += 1  # a stopped renewing (died): its lease ran out
    assert b.try_acquire() and not a.try_acquire()
    assert b.read() == LeaseRecord("b", clock.now, clock.now + 10, 1)
    b.release()  # a clean stop: the next try of another candidate takes it
    assert a.try_acquire()
    assert a.read().transitions == 2


def test_a_broken_file_is_taken_as_free(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "storage")
    path = lease_path(storage, "tiny")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert StorageLease(storage, path, "a").try_acquire()


def test_the_election_reports_changes_and_gives_up_on_stop(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "storage")
    path = lease_path(storage, "tiny")
    changes: list[tuple[str, bool]] = []
    first = LeaderElection(StorageLease(storage, path, "a", duration_s=30), renew_s=0.05,
                           on_change=lambda leads: changes.append(("a", leads)))  # fmt: skip
    second = LeaderElection(StorageLease(storage, path, "b", duration_s=30), renew_s=0.05,
                            on_change=lambda leads: changes.append(("b", leads)))  # fmt: skip

    async def scenario() -> None:
        await first.start()
        await asyncio.sleep(0.2)
        await second.start()
        await asyncio.sleep(0.2)
        assert first.is_leader and not second.is_leader
        await first.stop()  # releases: b takes over long before the 30 s expiry
        for _ in range(100):
            if second.is_leader:
                break
            await asyncio.sleep(0.05)
        await second.stop()

    asyncio.run(scenario())
    assert changes == [("a", True), ("b", True)]
    samples = next(iter(first.collect())).samples
    assert samples[0].labels == {"holder": "a"} and samples[0].value == 0
