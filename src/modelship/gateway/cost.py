"""What requests cost: a price per 1k input and output tokens for each variant, and a usage
ledger on storage that `modelship usage` reads.

A variant's price is set directly (`gateway.cost.variants`), or derived from what select
measured for it and what a replica costs to run (`gateway.cost.replica_hour`): a replica
that produces `throughput_tok_s` output tokens per second under load costs
`replica_hour / 3600 / throughput_tok_s` per output token, and its prompt processing rate
(select's prompt length over its TTFT at concurrency 1) prices input tokens the same way.
So a faster variant is cheaper per token, as it is to whoever pays for the machines.

The ledger is one JSON line per finished request (`models/<slug>/usage/<UTC date>.jsonl`:
time, tenant, model, release, variant, status, tokens, cost), appended as each request
ends; Prometheus has the same sums as counters, but counters restart with the gateway and
cannot answer "since when". Several gateways (replicas on Kubernetes, `modelship gateway
--usage-dir`) each append to a file of their own, `<UTC date>.<writer>.jsonl`: appends from
two hosts to one file on a network volume can interleave or overwrite each other, files of
their own cannot, and the reader sums every file of a day.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

USAGE_DIR = "usage"


@dataclass(frozen=True)
class Price:
    input_per_1k: float
    output_per_1k: float

    def of(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input_per_1k + output_tokens * self.output_per_1k) / 1000


def derive_price(
    replica_hour: float, throughput_tok_s: float, prompt_tokens: int, ttft_s: float
) -> Price:
    """The price per 1k tokens of a variant measured at `throughput_tok_s` output tokens/s
    under load and `ttft_s` for a `prompt_tokens` prompt alone, on a replica costing
    `replica_hour` per hour."""
    if throughput_tok_s <= 0 or ttft_s <= 0 or prompt_tokens <= 0:
        raise ValueError("a price needs positive throughput, TTFT and prompt length")
    per_second = replica_hour / 3600
    return Price(
        input_per_1k=per_second * 1000 * ttft_s / prompt_tokens,
        output_per_1k=per_second * 1000 / throughput_tok_s,
    )


@dataclass(frozen=True)
class UsageRecord:
    at: str  # ISO 8601, UTC
    tenant: str
    model: str
    release: str
    variant: str
    status: int
    input_tokens: int
    output_tokens: int
    cost: float | None  # None: no price for the variant


class UsageLedger:
    """Appends `UsageRecord`s to `folder/<UTC date>.jsonl` (`folder/<UTC date>.<writer>.jsonl`
    when the folder has other writers too), a line per request, written whole with one
    `write` (readers never see half a line)."""

    def __init__(self, folder: Path, writer: str | None = None) -> None:
        if writer is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", writer):
            raise ValueError(f"a ledger writer's name is letters, digits, - and _: {writer!r}")
        self.folder = folder
        self.writer = writer
        self._day: str | None = None
        self._file: IO[str] | None = None

    def append(self, record: UsageRecord) -> None:
        day = record.at[:10]
        try:
            if day != self._day or self._file is None:
                self.close()
                self.folder.mkdir(parents=True, exist_ok=True)
                name = f"{day}.jsonl" if self.writer is None else f"{day}.{self.writer}.jsonl"
                self._file = open(self.folder / name, "a", buffering=1)  # noqa: SIM115
                self._day = day
            self._file.write(json.dumps(record.__dict__, separators=(",", ":")) + "\n")
        except OSError as exc:  # a full disk must not fail requests; the counters still count
            logger.warning("usage ledger %s: %s", self.folder, exc)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def writer_name() -> str:
    """This process's name as a ledger writer: its host (the pod's name on Kubernetes) and
    process id."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


def now_utc() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def parse_since(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """`30m`, `2h`, `7d` (ago) or an ISO 8601 time (UTC unless it says otherwise)."""
    now = now or dt.datetime.now(dt.UTC)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if match:
        seconds = float(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]
        return now - dt.timedelta(seconds=seconds)
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"--since takes a duration (30m, 2h, 7d) or an ISO 8601 time, got {text!r}"
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)


def read_usage(folder: Path, since: dt.datetime) -> Iterator[UsageRecord]:
    """The ledger's records at or after `since`, from every writer's file (days before it
    are not opened)."""
    first_day = since.astimezone(dt.UTC).date().isoformat()
    for path in sorted(folder.glob("*.jsonl")):
        if path.name[:10] < first_day:  # <UTC date>[.<writer>].jsonl
            continue
        with path.open() as f:
            for line in f:
                try:
                    record = UsageRecord(**json.loads(line))
                except (ValueError, TypeError):  # a line cut by a crash: skipped, not fatal
                    continue
                if dt.datetime.fromisoformat(record.at) >= since:
                    yield record


def summarize(records: Iterable[UsageRecord]) -> list[dict[str, Any]]:
    """Totals per (tenant, model, variant), sorted by cost then tokens, largest first;
    `refused_requests` ended with an error status (the gateway records no tokens for those
    no replica counted: `accounting.RequestHold.end`)."""
    totals: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in records:
        row = totals.setdefault(
            (r.tenant, r.model, r.variant),
            {"tenant": r.tenant, "model": r.model, "variant": r.variant, "requests": 0,
             "input_tokens": 0, "output_tokens": 0, "cost": 0.0, "unpriced_requests": 0,
             "refused_requests": 0},
        )  # fmt: skip
        row["requests"] += 1
        row["refused_requests"] += r.status >= 400
        row["input_tokens"] += r.input_tokens
        row["output_tokens"] += r.output_tokens
        if r.cost is None:
            row["unpriced_requests"] += 1
        else:
            row["cost"] += r.cost
    return sorted(
        totals.values(),
        key=lambda row: (-row["cost"], -(row["input_tokens"] + row["output_tokens"])),
    )
