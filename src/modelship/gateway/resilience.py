"""Failure handling per replica: a circuit breaker, passive outlier detection, retries.

The breaker reacts to a run of consecutive failures (a replica that died); the outlier
detector to a high error rate over a window (a replica that limps). An endpoint is
routable only while both let it through. Both read time from an injected `clock`.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

Clock = Callable[[], float]


class BreakerState(StrEnum):
    CLOSED = "closed"  # requests flow; consecutive failures are counted
    OPEN = "open"  # nothing flows until the cool-down ends
    HALF_OPEN = "half_open"  # one probe may go; its result closes or reopens


class CircuitBreaker:
    """closed -> open after `failure_threshold` consecutive failures; open for
    `cool_down_s`; then half-open, where exactly one probe request is let through: its
    success closes the breaker, its failure opens it again for another cool-down.

    A probe whose result never arrives (a cancelled request) would hold the breaker
    half-open forever, so after `probe_timeout_s` another probe may go.
    """

    def __init__(
        self,
        failure_threshold: int = 5,
        cool_down_s: float = 10.0,
        probe_timeout_s: float | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        if cool_down_s < 0:
            raise ValueError("cool_down_s must be >= 0")
        self.failure_threshold = failure_threshold
        self.cool_down_s = cool_down_s
        self.probe_timeout_s = cool_down_s if probe_timeout_s is None else probe_timeout_s
        self.clock = clock
        self.num_consecutive_failures = 0
        self._opened_at: float | None = None  # None while closed
        self._probe_sent_at: float | None = None

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self.clock() < self._opened_at + self.cool_down_s:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def can_send(self) -> bool:
        """Whether `allow_request` would say yes now; changes nothing (for routability)."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN:
            return False
        return self._probe_sent_at is None or (
            self.clock() >= self._probe_sent_at + self.probe_timeout_s
        )

    def allow_request(self) -> bool:
        """Claim the right to send one request; in half-open this takes the probe slot."""
        if not self.can_send():
            return False
        if self.state is BreakerState.HALF_OPEN:
            self._probe_sent_at = self.clock()
        return True

    def record_success(self) -> None:
        if self.state is BreakerState.OPEN:
            return  # a straggler sent before the breaker opened proves nothing
        self.num_consecutive_failures = 0
        self._opened_at = None
        self._probe_sent_at = None

    def record_failure(self) -> None:
        state = self.state
        if state is BreakerState.OPEN:
            return  # stragglers must not stretch the cool-down
        self.num_consecutive_failures += 1
        if state is BreakerState.HALF_OPEN or (
            self.num_consecutive_failures >= self.failure_threshold
        ):
            self._opened_at = self.clock()
            self._probe_sent_at = None


@dataclass
class _Bucket:
    start: float
    num_ok: int = 0
    num_failed: int = 0


class OutlierDetector:
    """Passive ejection on error rate, per endpoint.

    Results are counted in `bucket_s` buckets over the last `window_s`, so memory per
    endpoint is bounded whatever the request rate. Once at least `min_requests` results in
    the window have an error rate of `max_error_rate` or more, the endpoint is ejected
    for `ejection_s` and its window starts afresh. At most `max_ejected_fraction` of the
    known endpoints (rounded down) are ejected at once, so a fleet-wide problem (a bad
    release, an overloaded cluster) does not eject every replica; a single replica is
    never ejected (its circuit breaker still guards it).
    """

    def __init__(
        self,
        window_s: float = 30.0,
        bucket_s: float = 1.0,
        min_requests: int = 10,
        max_error_rate: float = 0.5,
        ejection_s: float = 30.0,
        max_ejected_fraction: float = 0.5,
        clock: Clock = time.monotonic,
    ) -> None:
        if window_s <= 0 or bucket_s <= 0 or bucket_s > window_s:
            raise ValueError("need 0 < bucket_s <= window_s")
        if min_requests < 1 or not 0 < max_error_rate <= 1:
            raise ValueError("need min_requests >= 1 and 0 < max_error_rate <= 1")
        if ejection_s < 0 or not 0 <= max_ejected_fraction <= 1:
            raise ValueError("need ejection_s >= 0 and 0 <= max_ejected_fraction <= 1")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.min_requests = min_requests
        self.max_error_rate = max_error_rate
        self.ejection_s = ejection_s
        self.max_ejected_fraction = max_ejected_fraction
        self.clock = clock
        self._windows: dict[str, deque[_Bucket]] = {}
        self._ejected_until: dict[str, float] = {}

    def set_endpoints(self, endpoint_ids: Iterable[str]) -> None:
        """The current fleet; state of endpoints no longer in it is dropped."""
        ids = set(endpoint_ids)
        self._windows = {i: self._windows.get(i, deque()) for i in ids}
        self._ejected_until = {i: t for i, t in self._ejected_until.items() if i in ids}

    def is_ejected(self, endpoint_id: str) -> bool:
        return self.clock() < self._ejected_until.get(endpoint_id, -math.inf)

    def num_ejected(self) -> int:
        return sum(self.is_ejected(endpoint_id) for endpoint_id in self._ejected_until)

    def error_rate(self, endpoint_id: str) -> tuple[float, int]:
        """(error rate, number of results) over the current window."""
        window = self._current_window(endpoint_id)
        num_failed = sum(bucket.num_failed for bucket in window)
        total = num_failed + sum(bucket.num_ok for bucket in window)
        return (num_failed / total if total else 0.0), total

    def record_result(self, endpoint_id: str, ok: bool) -> bool:
        """Count one result; returns True when it ejects the endpoint."""
        if endpoint_id not in self._windows:
            self._windows[endpoint_id] = deque()
        window = self._current_window(endpoint_id)
        now = self.clock()
        if not window or now >= window[-1].start + self.bucket_s:
            window.append(_Bucket(start=now - (now % self.bucket_s)))
        if ok:
            window[-1].num_ok += 1
        else:
            window[-1].num_failed += 1
        return not ok and self._maybe_eject(endpoint_id)

    def _maybe_eject(self, endpoint_id: str) -> bool:
        if self.is_ejected(endpoint_id):
            return False
        rate, total = self.error_rate(endpoint_id)
        if total < self.min_requests or rate < self.max_error_rate:
            return False
        max_ejected = math.floor(self.max_ejected_fraction * len(self._windows))
        if self.num_ejected() >= max_ejected:
            return False
        self._ejected_until[endpoint_id] = self.clock() + self.ejection_s
        self._windows[endpoint_id].clear()  # judge it afresh when it comes back
        return True

    def _current_window(self, endpoint_id: str) -> deque[_Bucket]:
        window = self._windows.get(endpoint_id, deque())
        oldest = self.clock() - self.window_s
        while window and window[0].start + self.bucket_s <= oldest:
            window.popleft()
        return window


class FailureKind(StrEnum):
    CONNECT = "connect"  # no connection to the replica: nothing was sent
    STATUS = "status"  # the replica answered with an error status
    # The replica closed the connection before any byte of its answer (it died mid-request):
    # nothing reached the client, so another replica can answer instead.
    DISCONNECT = "disconnect"
    READ = "read"  # the connection broke while the response was streaming
    TIMEOUT = "timeout"
    # A 200 that is no answer: a body that is not a JSON object, a "stream" that is not an
    # event stream or has no event at all. Passed on, the client would get garbage.
    INVALID = "invalid"
    # The replica stopped answering its health checks while the attempt waited on it (a
    # hung process): the attempt was abandoned before any byte of an answer.
    UNRESPONSIVE = "unresponsive"


_RETRYABLE_KINDS = frozenset(
    {FailureKind.CONNECT, FailureKind.DISCONNECT, FailureKind.INVALID, FailureKind.UNRESPONSIVE}
)


@dataclass(frozen=True)
class Failure:
    """One failed attempt. `sent_to_client`: some of the response already went out, so
    a retry would duplicate or splice output."""

    kind: FailureKind
    status_code: int | None = None
    sent_to_client: bool = False


# A replica's own failure, answered before anything reached the client: 503 (draining,
# overloaded, its engine dead), 500 (it failed the request), 502/504 (a proxy in front of
# it gave up). Another replica may well answer; 4xx are the request's own fault.
RETRYABLE_STATUS_CODES = frozenset({500, 502, 503, 504})


class RetryPolicy:
    """When to retry a failed attempt on another replica, and how long to wait first.

    Retried, and only before any byte reached the client: a refused connection (nothing was
    sent), a retryable status (`RETRYABLE_STATUS_CODES`), a replica that dropped the
    connection before answering (it crashed: the client must not see that), an answer that
    is no answer (`INVALID`), and an attempt abandoned on a hung replica (`UNRESPONSIVE`).
    Timeouts and reads broken mid-response are not retried: the replica is slow rather than
    gone, or part of the answer is out, and generation is too expensive to run twice. The
    delay is "full jitter": uniform in [0, min(max_backoff_s, base_backoff_s * 2**(attempt
    - 1))].
    """

    def __init__(
        self,
        max_attempts: int = 3,
        base_backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        retryable_status_codes: frozenset[int] = RETRYABLE_STATUS_CODES,
        rng: random.Random | None = None,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if base_backoff_s < 0 or max_backoff_s < 0:
            raise ValueError("backoffs must be >= 0")
        self.max_attempts = max_attempts
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.retryable_status_codes = retryable_status_codes
        self.rng = rng or random.Random()

    def is_retryable(self, failure: Failure) -> bool:
        if failure.sent_to_client:
            return False
        if failure.kind in _RETRYABLE_KINDS:
            return True
        return (
            failure.kind is FailureKind.STATUS
            and failure.status_code in self.retryable_status_codes
        )

    def should_retry(self, failure: Failure, num_attempts: int) -> bool:
        """After `num_attempts` attempts (the failed one included), try once more?"""
        return num_attempts < self.max_attempts and self.is_retryable(failure)

    def backoff_s(self, num_attempts: int) -> float:
        """The wait before attempt `num_attempts + 1`."""
        cap = min(self.max_backoff_s, self.base_backoff_s * 2 ** max(0, num_attempts - 1))
        return self.rng.uniform(0.0, cap)
