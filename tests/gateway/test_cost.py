"""Prices per 1k tokens and the usage ledger `modelship usage` reads."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from modelship.gateway.cost import (
    Price,
    UsageLedger,
    UsageRecord,
    derive_price,
    parse_since,
    read_usage,
    summarize,
)


def test_a_price_follows_from_measured_speed_and_the_replica_hour() -> None:
    # $3.60 an hour = $0.001 a second; 10 output tok/s -> $0.0001 a token -> $0.1 per 1k;
    # a 100-token prompt in 0.5 s = 200 tok/s -> $0.005 per 1k input tokens
    price = derive_price(3.6, throughput_tok_s=10.0, prompt_tokens=100, ttft_s=0.5)
    assert price.output_per_1k == pytest.approx(0.1)
    assert price.input_per_1k == pytest.approx(0.005)
    assert price.of(2000, 500) == pytest.approx(2 * 0.005 + 0.5 * 0.1)
    faster = derive_price(3.6, throughput_tok_s=20.0, prompt_tokens=100, ttft_s=0.25)
    assert faster.output_per_1k < price.output_per_1k  # a faster variant is cheaper
    with pytest.raises(ValueError, match="positive throughput"):
        derive_price(3.6, throughput_tok_s=0.0, prompt_tokens=100, ttft_s=0.5)


def record(at: str, tenant: str, inp: int, out: int, cost: float | None) -> UsageRecord:
    return UsageRecord(at, tenant, "m", "1", "gptq", 200, inp, out, cost)


def test_the_ledger_sums_per_tenant_since_a_time(tmp_path: Path) -> None:
    ledger = UsageLedger(tmp_path)
    ledger.append(record("2026-11-22T23:59:00.000+00:00", "a", 10, 5, 0.5))
    ledger.append(record("2026-11-23T10:00:00.000+00:00", "a", 20, 10, 1.0))
    ledger.append(record("2026-11-23T11:00:00.000+00:00", "a", 30, 15, None))
    ledger.append(record("2026-11-23T12:00:00.000+00:00", "b", 1, 1, 0.25))
    ledger.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2026-11-22.jsonl", "2026-11-23.jsonl"]
    with (tmp_path / "2026-11-23.jsonl").open("a") as f:
        f.write('{"at": "2026-11-23T13:0')  # a line cut by a crash
    since = dt.datetime(2026, 11, 23, 9, tzinfo=dt.UTC)
    rows = summarize(read_usage(tmp_path, since))
    assert rows == [
        {"tenant": "a", "model": "m", "variant": "gptq", "requests": 2, "input_tokens": 50,
         "output_tokens": 25, "cost": 1.0, "unpriced_requests": 1, "refused_requests": 0},
        {"tenant": "b", "model": "m", "variant": "gptq", "requests": 1, "input_tokens": 1,
         "output_tokens": 1, "cost": 0.25, "unpriced_requests": 0, "refused_requests": 0},
    ]  # fmt: skip
    everything = summarize(read_usage(tmp_path, since - dt.timedelta(days=2)))
    assert everything[0]["requests"] == 3 and everything[0]["cost"] == pytest.approx(1.5)


def test_since_takes_durations_and_times() -> None:
    now = dt.datetime(2026, 11, 23, 12, tzinfo=dt.UTC)
    assert parse_since("90m", now) == now - dt.timedelta(minutes=90)
    assert parse_since("7d", now) == now - dt.timedelta(days=7)
    assert parse_since("2026-11-23T08:00:00", now) == dt.datetime(2026, 11, 23, 8, tzinfo=dt.UTC)
    with pytest.raises(ValueError, match="--since takes a duration"):
        parse_since("yesterday", now)
    assert Price(1.0, 2.0).of(1000, 1000) == 3.0
