"""Circuit breaker, outlier detection and retry policy, driven by a fake clock."""

from __future__ import annotations

import random

import pytest

from modelship.gateway import (
    BreakerState,
    CircuitBreaker,
    Failure,
    FailureKind,
    OutlierDetector,
    RetryPolicy,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --- circuit breaker -------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_only() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, cool_down_s=10, clock=clock)
    for _ in range(2):
        breaker.record_failure()
    breaker.record_success()  # resets the run
    for _ in range(2):
        breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED and breaker.allow_request()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert not breaker.can_send() and not breaker.allow_request()


def test_breaker_half_open_lets_exactly_one_probe_then_closes() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cool_down_s=10, clock=clock)
    breaker.record_failure()
    clock.advance(9.99)
    assert breaker.state is BreakerState.OPEN and not breaker.can_send()
    clock.advance(0.01)
    assert breaker.state is BreakerState.HALF_OPEN and breaker.can_send()
    assert breaker.allow_request()  # the probe
    assert not breaker.can_send() and not breaker.allow_request()  # nobody else
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.num_consecutive_failures == 0
    assert all(breaker.allow_request() for _ in range(5))


def test_breaker_failed_probe_reopens_for_a_full_cool_down() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, cool_down_s=10, clock=clock)
    breaker.record_failure()
    breaker.record_failure()
    clock.advance(10)
    assert breaker.allow_request()
    clock.advance(3)
    breaker.record_failure()  # one failure in half-open is enough
    assert breaker.state is BreakerState.OPEN
    clock.advance(9.9)
    assert breaker.state is BreakerState.OPEN
    clock.advance(0.1)
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allow_request()


def test_breaker_stragglers_while_open_change_nothing() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cool_down_s=10, clock=clock)
    breaker.record_failure()
    clock.advance(5)
    breaker.record_failure()  # would restart the cool-down if counted
    breaker.record_success()  # would close it if counted
    assert breaker.state is BreakerState.OPEN
    clock.advance(5)
    assert breaker.state is BreakerState.HALF_OPEN


def test_breaker_lost_probe_is_replaced_after_timeout() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cool_down_s=10, probe_timeout_s=4, clock=clock)
    breaker.record_failure()
    clock.advance(10)
    assert breaker.allow_request()
    clock.advance(3.9)
    assert not breaker.allow_request()
    clock.advance(0.1)
    assert breaker.allow_request()
    assert not breaker.allow_request()


# --- outlier detection -----------------------------------------------------------------


def make_detector(clock: FakeClock, **options) -> OutlierDetector:
    detector = OutlierDetector(
        window_s=30, min_requests=10, max_error_rate=0.5, ejection_s=20, clock=clock, **options
    )
    detector.set_endpoints(["a", "b", "c", "d"])
    return detector


def test_outlier_ejected_on_error_rate_for_a_period() -> None:
    clock = FakeClock()
    detector = make_detector(clock)
    for i in range(9):
        assert not detector.record_result("a", ok=i % 3 == 0)  # 3 ok, 6 failed
        clock.advance(0.5)
    assert not detector.is_ejected("a")  # 9 results: below min_requests
    assert detector.record_result("a", ok=False)  # 7 of 10 failed
    assert detector.is_ejected("a") and not detector.is_ejected("b")
    clock.advance(19.9)
    assert detector.is_ejected("a")
    clock.advance(0.1)
    assert not detector.is_ejected("a")
    assert detector.error_rate("a") == (0.0, 0)  # judged afresh


def test_outlier_tolerates_a_low_error_rate() -> None:
    clock = FakeClock()
    detector = make_detector(clock)
    for i in range(100):
        detector.record_result("a", ok=i % 5 != 0)  # 20% errors
    assert not detector.is_ejected("a")
    assert detector.error_rate("a") == (0.2, 100)


def test_outlier_window_forgets_old_results() -> None:
    clock = FakeClock()
    detector = make_detector(clock)
    for _ in range(8):
        detector.record_result("a", ok=False)
    clock.advance(31)
    for _ in range(4):
        detector.record_result("a", ok=False)
    assert not detector.is_ejected("a")
    assert detector.error_rate("a") == (1.0, 4)


def test_outlier_never_ejects_most_of_the_fleet() -> None:
    clock = FakeClock()
    detector = make_detector(clock, max_ejected_fraction=0.5)
    for endpoint_id in ["a", "b", "c", "d"]:
        for _ in range(10):
            detector.record_result(endpoint_id, ok=False)
    assert [detector.is_ejected(i) for i in "abcd"] == [True, True, False, False]
    lone = OutlierDetector(min_requests=1, clock=clock)
    lone.set_endpoints(["only"])
    for _ in range(50):
        lone.record_result("only", ok=False)
    assert not lone.is_ejected("only")


def test_outlier_forgets_removed_endpoints() -> None:
    clock = FakeClock()
    detector = make_detector(clock)
    for _ in range(10):
        detector.record_result("a", ok=False)
    detector.set_endpoints(["b", "c"])
    assert not detector.is_ejected("a") and detector.num_ejected() == 0


# --- retries ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "retryable"),
    [
        (Failure(FailureKind.CONNECT), True),
        (Failure(FailureKind.STATUS, 503), True),
        (Failure(FailureKind.STATUS, 503, sent_to_client=True), False),
        # A replica's own 5xx before any byte: another replica may answer (fleet drill:
        # a replica answering 500s reached clients until its breaker opened).
        (Failure(FailureKind.STATUS, 500), True),
        (Failure(FailureKind.STATUS, 502), True),
        (Failure(FailureKind.STATUS, 504), True),
        (Failure(FailureKind.STATUS, 500, sent_to_client=True), False),
        (Failure(FailureKind.STATUS, 429), False),
        (Failure(FailureKind.STATUS, 400), False),
        (Failure(FailureKind.INVALID), True),
        (Failure(FailureKind.UNRESPONSIVE), True),
        (Failure(FailureKind.READ), False),
        (Failure(FailureKind.TIMEOUT), False),
    ],
)
def test_retryable_failures(failure: Failure, retryable: bool) -> None:
    assert RetryPolicy().is_retryable(failure) is retryable


def test_retry_stops_at_max_attempts() -> None:
    policy = RetryPolicy(max_attempts=3)
    failure = Failure(FailureKind.CONNECT)
    assert [policy.should_retry(failure, n) for n in (1, 2, 3)] == [True, True, False]


def test_backoff_is_full_jitter_under_a_doubling_cap() -> None:
    policy = RetryPolicy(base_backoff_s=0.1, max_backoff_s=0.5, rng=random.Random(7))
    for num_attempts, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (10, 0.5)]:
        samples = [policy.backoff_s(num_attempts) for _ in range(200)]
        assert all(0 <= s <= cap for s in samples)
        assert max(samples) > 0.9 * cap and min(samples) < 0.1 * cap
    first, second = (RetryPolicy(rng=random.Random(3)) for _ in range(2))
    assert [first.backoff_s(2) for _ in range(5)] == [second.backoff_s(2) for _ in range(5)]
