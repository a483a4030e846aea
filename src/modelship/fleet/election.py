"""Electing the one gateway that runs the fleet's run-once work (the canary judge, the drift
probe), with a lease on the shared storage where there is no Kubernetes API server.

The lease is a file, `models/<slug>/fleet/leader.json`: the holder's id, when it was
acquired and when it expires. Every candidate tries each `renew_s` under the storage's lock
on that file (`Storage.lock`, an flock): the holder extends its expiry; anyone else takes
the lease only once it has expired (a holder that died, or hung past `duration_s`); a
holder that stops cleanly gives it up (expiry now), so the next candidate takes over at its
next try. `transitions` counts the changes of holder.

Times are wall-clock seconds (`time.time()`), compared across machines: keep `duration_s`
well above their clock skew and above `renew_s` (three renewals per duration by default).
A holder learns it lost the lease only at its next try, so run-once work must tolerate one
renewal period of overlap after a hang (the judge's decisions are idempotent on storage).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from modelship.gateway.metrics import PREFIX
from modelship.storage import Storage
from modelship.storage.store import write_json_atomic

logger = logging.getLogger(__name__)

LEASE_FILE = "leader.json"


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    acquired_at: float
    expires_at: float
    transitions: int = 0


def next_record(
    record: LeaseRecord | None, candidate: str, now: float, duration_s: float
) -> LeaseRecord | None:
    """The lease after `candidate` tries at `now`: renewed or taken (a new record with
    `candidate` holding it until `now + duration_s`), or None where another holder's lease
    has not expired."""
    expires_at = now + duration_s
    if record is None:
        return LeaseRecord(candidate, now, expires_at)
    if record.holder == candidate:
        return LeaseRecord(candidate, record.acquired_at, expires_at, record.transitions)
    if record.expires_at <= now:
        return LeaseRecord(candidate, now, expires_at, record.transitions + 1)
    return None


def lease_path(storage: Storage, slug: str) -> Path:
    return storage.model_dir(slug) / "fleet" / LEASE_FILE


class StorageLease:
    """One candidate's view of the lease file."""

    def __init__(
        self,
        storage: Storage,
        path: Path,
        candidate: str,
        duration_s: float = 15.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.storage = storage
        self.path = path
        self.candidate = candidate
        self.duration_s = duration_s
        self.clock = clock

    def read(self) -> LeaseRecord | None:
        """The lease as written (None: none yet, or a file that is not a lease: it is
        replaced at the next try)."""
        try:
            return LeaseRecord(**json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            logger.warning("%s is not a lease (%s): taken as free", self.path, exc)
            return None

    def try_acquire(self) -> bool:
        """Renew or take the lease; True when this candidate holds it now."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.storage.lock(self.path):
            record = next_record(self.read(), self.candidate, self.clock(), self.duration_s)
            if record is None:
                return False
            write_json_atomic(self.path, asdict(record))
            return True

    def release(self) -> None:
        """Give the lease up if this candidate holds it (it expires now)."""
        with self.storage.lock(self.path):
            record = self.read()
            if record is not None and record.holder == self.candidate:
                ended = LeaseRecord(record.holder, record.acquired_at, self.clock(),
                                    record.transitions)  # fmt: skip
                write_json_atomic(self.path, asdict(ended))


class LeaderElection(Collector):
    """Tries the lease every `renew_s` (a third of its duration by default) and says whether
    this process leads (`is_leader`, the `modelship_gateway_leader` gauge); `on_change` hears
    each change. A try that fails (the storage unreachable) counts as not leading: a leader
    that cannot renew must assume another one took over."""

    def __init__(
        self,
        lease: StorageLease,
        renew_s: float | None = None,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.lease = lease
        self.renew_s = renew_s if renew_s is not None else lease.duration_s / 3
        self.on_change = on_change
        self.is_leader = False
        self._task: asyncio.Task | None = None

    def tick(self) -> bool:
        try:
            leads = self.lease.try_acquire()
        except OSError as exc:
            logger.warning("the leader lease %s could not be read or written: %s",
                           self.lease.path, exc)  # fmt: skip
            leads = False
        if leads != self.is_leader:
            logger.info("%s %s the leader lease %s", self.lease.candidate,
                        "holds" if leads else "no longer holds", self.lease.path)  # fmt: skip
            self.is_leader = leads
            if self.on_change is not None:
                self.on_change(leads)
        return leads

    async def run(self) -> None:
        while True:
            await asyncio.to_thread(self.tick)  # flock waits: off the event loop
            await asyncio.sleep(self.renew_s)

    async def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.is_leader:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self.lease.release)
            self.is_leader = False

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily(
            PREFIX + "leader",
            "1 while this gateway holds the lease of the fleet's run-once work.",
            labels=["holder"],
        )
        gauge.add_metric([self.lease.candidate], 1.0 if self.is_leader else 0.0)
        yield gauge
