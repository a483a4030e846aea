"""Gateway-wide admission: the cap, and shedding the lowest priority first."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from modelship.gateway import AdmissionConfig, AdmissionQueue, Priority
from modelship.gateway.admission import retry_after_header


def test_config_checks_the_order_of_fill_levels() -> None:
    with pytest.raises(ValidationError, match="low_priority_fill must not exceed"):
        AdmissionConfig(low_priority_fill=0.9, normal_priority_fill=0.8)
    with pytest.raises(ValidationError, match="extra"):
        AdmissionConfig(max_queue=3)


def test_lowest_priority_is_shed_first() -> None:
    queue = AdmissionQueue(AdmissionConfig(max_requests=10, retry_after_s=2.0))
    first_refused_at: dict[Priority, int] = {}
    while queue.num_held < 10:
        for priority in Priority:
            if priority not in first_refused_at and not queue.can_admit(priority):
                first_refused_at[priority] = queue.num_held
        # Fill with high priority so each level's threshold is crossed in turn.
        assert queue.try_admit(Priority.HIGH).ok
    assert first_refused_at == {Priority.LOW: 5, Priority.NORMAL: 8}
    low = queue.try_admit(Priority.LOW)
    assert not low.ok and low.status_code == 503 and low.retry_after_s == 2.0
    high = queue.try_admit(Priority.HIGH)
    assert not high.ok and high.reason == "queue_full"


def test_shed_and_recover_under_mixed_load() -> None:
    queue = AdmissionQueue(AdmissionConfig(max_requests=4, low_priority_fill=0.5))
    assert queue.try_admit(Priority.LOW).ok and queue.try_admit(Priority.LOW).ok
    shed = queue.try_admit(Priority.LOW)
    assert not shed.ok and shed.reason == "priority_shed" and "low-priority" in shed.message
    assert queue.try_admit(Priority.NORMAL).ok  # normal still gets in at 2/4 (limit 3)
    assert not queue.try_admit(Priority.NORMAL).ok
    assert queue.try_admit(Priority.HIGH).ok
    assert queue.num_held_by_priority() == {Priority.LOW: 2, Priority.NORMAL: 1, Priority.HIGH: 1}
    queue.release(Priority.LOW)
    queue.release(Priority.LOW)
    assert not queue.try_admit(Priority.LOW).ok  # 2 of 4 held: still over low's level
    queue.release(Priority.HIGH)
    assert queue.try_admit(Priority.LOW).ok
    for _ in range(10):
        queue.release(Priority.HIGH)
    assert queue.num_held_by_priority()[Priority.HIGH] == 0


def test_an_idle_gateway_admits_every_priority() -> None:
    queue = AdmissionQueue(AdmissionConfig(max_requests=1, low_priority_fill=0.1))
    assert queue.limit(Priority.LOW) == 1
    assert queue.try_admit(Priority.LOW).ok
    assert not queue.try_admit(Priority.HIGH).ok


def test_a_request_holds_a_slot_per_sequence() -> None:
    queue = AdmissionQueue(AdmissionConfig(max_requests=8, low_priority_fill=0.5))
    assert queue.try_admit(Priority.HIGH, num_sequences=5).ok
    assert queue.num_held == 5
    refused = queue.try_admit(Priority.HIGH, num_sequences=4)
    assert not refused.ok and refused.reason == "queue_full" and refused.status_code == 503
    assert queue.try_admit(Priority.HIGH, num_sequences=3).ok
    queue.release(Priority.HIGH, num_sequences=5)
    assert queue.num_held == 3
    never = queue.try_admit(Priority.LOW, num_sequences=5)  # low may hold 4 at most
    assert not never.ok and never.reason == "too_many_sequences" and never.status_code == 400
    assert queue.num_held == 3


def test_retry_after_header_is_whole_seconds() -> None:
    assert retry_after_header(0.0) == "1"
    assert retry_after_header(0.2) == "1"
    assert retry_after_header(2.0) == "2"
    assert retry_after_header(2.1) == "3"
