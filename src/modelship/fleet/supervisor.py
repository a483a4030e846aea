"""The local supervisor: replica processes started, made routable, drained, restarted.

Replicas come in groups (`gateway/groups.py`): the stable and canary tracks of the
primary tier, one group per cheaper tier (`gateway.tiers`), and the stable group of each
other model served beside the primary (`models:`), scaled by its own settings. Each group has a
`GroupState`: the release it serves, its autoscaler policy (the canary: a fixed
`canary_replicas`), its warm pool, its crash backoff and its times to ready. Every group
goes through the same steps.

A control loop on the gateway's event loop. Each tick it (1) looks at every replica
process: a starting one joins routing when its /ready answers 200 (time-to-capacity is
recorded), a dead one leaves routing and is replaced after a backoff, and so is a ready one
whose /health answers 503 (its engine died or stalled: the process lives on, useless) or
nothing for `max_unresponsive_s` (hung); a canary whose replicas keep failing is given up
(`on_canary_failed`: the fleet rolls it back); (2) per group, drains replicas of a release
no longer wanted (`_retire_stale`) once the wanted release has a ready replica (a stale one
still starting at once); (3) per group, asks the group's policy how many replicas its load
needs and starts or drains the difference (`_scale`), for the load expected once a
replica started now would be ready (the policy extrapolates the in-flight trend over the
median of the group's recorded times to ready). With `warm_pool`, that many more replicas
of each autoscaled group are kept ready but out of routing (STANDBY): a scale-out routes
one of them at once and starts a replacement, and a scale-in parks an idle routed replica
there rather than stopping it. Draining means: out of routing at once, SIGTERM once the
gateway has no request in flight there (the replica then drains itself), SIGKILL after
`drain_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import statistics
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import httpx

from modelship.autoscale.policy import AutoscalerPolicy
from modelship.fleet.config import AutoscaleConfig
from modelship.fleet.metrics import FleetMetrics
from modelship.gateway.groups import CANARY, STABLE, Group, model_group, tier_group
from modelship.gateway.metrics import FleetSnapshot
from modelship.gateway.pool import EndpointPool
from modelship.gateway.tiers import TierConfig
from modelship.server.process import ReplicaProcess

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReleaseSpec:
    """What a group serves: a release folder and the variant it holds, and for another
    model than the primary its served name (None: the primary's)."""

    release: int
    model_dir: Path
    variant: str
    model: str | None = None


class ReplicaState(StrEnum):
    STARTING = "starting"
    READY = "ready"  # in routing
    STANDBY = "standby"  # ready, out of routing: the warm pool
    DRAINING = "draining"


@dataclass(eq=False)
class ManagedReplica:
    replica_id: str
    group: Group
    spec: ReleaseSpec
    process: ReplicaProcess
    started_at: float  # on the supervisor's clock, like every `now` it compares with
    state: ReplicaState = ReplicaState.STARTING
    drain_started_at: float | None = None
    terminate_sent: bool = False
    unanswered_since: float | None = None  # ready, but /health has not answered since


Launcher = Callable[[ReleaseSpec, str], ReplicaProcess]


@dataclass
class GroupState:
    """One group's wanted release and how it is scaled. `policy` None: the group runs a
    fixed `fixed_replicas` while it has a target (the canary)."""

    policy: AutoscalerPolicy | None
    fixed_replicas: int = 0
    warm_pool: int = 0  # replicas kept ready beyond what routing wants
    target: ReleaseSpec | None = None
    desired: int = 0
    num_crashes: int = 0  # consecutive, reset when a replica becomes ready
    num_failures: int = 0  # every crash or replacement since the target was set
    next_start_at: float = 0.0
    # The latest replicas' times from start to /ready: what a scale-out waits for.
    time_to_ready_s: deque[float] = field(default_factory=lambda: deque(maxlen=16))
    routable_wanted: int = 0  # replicas the autoscaler wants in routing (the rest: warm pool)
    short_since: float | None = None  # routing has had fewer replicas than wanted since


class Supervisor:
    def __init__(
        self,
        config: AutoscaleConfig,
        pool: EndpointPool,
        metrics: FleetMetrics | None,
        launch: Launcher,
        clock: Callable[[], float] = time.monotonic,
        tiers: Sequence[TierConfig] = (),
        models: Mapping[str, AutoscaleConfig] | None = None,
    ) -> None:
        """`tiers`: the cheaper tiers run beside the primary; `models`: each other model's
        served name and autoscaling."""
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.launch = launch
        self.clock = clock
        self.replicas: list[ManagedReplica] = []
        self.groups: dict[Group, GroupState] = {
            STABLE: GroupState(AutoscalerPolicy(config), warm_pool=config.warm_pool),
            CANARY: GroupState(None, fixed_replicas=config.canary_replicas),
        }
        # Each cheaper tier is scaled on its own load between its own bounds.
        for tier in tiers:
            bounds = {"min_replicas": tier.min_replicas, "max_replicas": tier.max_replicas}
            policy = AutoscalerPolicy(config.model_copy(update=bounds))
            self.groups[tier_group(tier.name)] = GroupState(policy, warm_pool=config.warm_pool)
        for name, scaling in (models or {}).items():
            state = GroupState(AutoscalerPolicy(scaling), warm_pool=scaling.warm_pool)
            self.groups[model_group(name)] = state
        self._num_started = 0
        self._client: httpx.AsyncClient | None = None
        # Called with the reason once the canary's replicas have failed
        # `max_canary_failures` times (the fleet then ends the canary).
        self.on_canary_failed: Callable[[str], None] | None = None

    # Targets -----------------------------------------------------------------------------
    def set_target(self, group: Group, spec: ReleaseSpec | None) -> None:
        """Serve `spec` on `group` (None: nothing). Replicas of the old release are drained
        once the new one has a ready replica. When stable moves to the canary's release
        (a promotion), the canary's replicas become stable ones: nothing restarts."""
        if group not in self.groups:
            known = ", ".join(str(g) for g in self.groups)
            raise ValueError(f"no replica group {group}; the supervisor runs: {known}")
        state = self.groups[group]
        if state.target == spec:
            return
        logger.info("%s: release %s -> %s", group, _release(state.target), _release(spec))
        state.target = spec
        state.num_crashes = state.num_failures = 0
        if group == STABLE and spec is not None:
            for replica in self.replicas:
                if replica.group == CANARY and replica.spec == spec:
                    replica.group = STABLE
                    self.pool.retag(replica.replica_id, STABLE)

    def time_to_ready_s(self, group: Group = STABLE) -> list[float]:
        return list(self.groups[group].time_to_ready_s)

    def expected_time_to_ready_s(self, group: Group = STABLE) -> float:
        """How long a replica of `group` started now will take to become ready: the median
        of the group's latest recorded starts (one slow first start, e.g. a kernel build,
        does not set it), `initial_time_to_ready_s` before any."""
        times = self.groups[group].time_to_ready_s
        return statistics.median(times) if times else self.config.initial_time_to_ready_s

    def count(self, group: Group, *states: ReplicaState, current: bool = True) -> int:
        target = self.groups[group].target
        return sum(
            1
            for r in self.replicas
            if r.group == group and r.state in states and (not current or r.spec == target)
        )

    # Control loop ------------------------------------------------------------------------
    async def run(self) -> None:
        self._client = httpx.AsyncClient(timeout=1.0)
        try:
            while True:
                try:
                    await self.tick()
                except Exception:  # the loop must outlive any one bad tick
                    logger.exception("supervisor tick failed")
                await asyncio.sleep(self.config.tick_s)
        finally:
            await self._client.aclose()

    async def tick(self) -> None:
        now = self.clock()
        await self._observe(now)
        for group in self.groups:
            self._retire_stale(group, now)
            self._scale(group, self._desired(group, now), now)

    async def _observe(self, now: float) -> None:
        starting = [r for r in self.replicas if r.state is ReplicaState.STARTING]
        serving = [
            r for r in self.replicas if r.state in (ReplicaState.READY, ReplicaState.STANDBY)
        ]
        answers = await asyncio.gather(
            *(self._is_ready(r) for r in starting), *(self._health(r) for r in serving)
        )
        ready, health = answers[: len(starting)], answers[len(starting) :]
        for replica, is_ready in zip(starting, ready, strict=True):
            if replica.process.has_exited():
                self._crashed(replica, now)
            elif is_ready:
                self._became_ready(replica, now)
            elif now - replica.started_at > self.config.replica_start_timeout_s:
                logger.error(
                    "%s not ready after %.0fs", replica.replica_id, now - replica.started_at
                )
                replica.process.kill()
                self._crashed(replica, now)
        for replica, status in zip(serving, health, strict=True):
            if replica.process.has_exited():
                self._crashed(replica, now)
            elif status is not None and status >= 500:
                self._replace(replica, now, f"/health answered {status}")
            elif status is None:
                replica.unanswered_since = replica.unanswered_since or now
                silent_s = now - replica.unanswered_since
                if silent_s > self.config.max_unresponsive_s:
                    self._replace(replica, now, f"no answer to /health for {silent_s:.0f}s")
            else:
                replica.unanswered_since = None
        for replica in list(self.replicas):
            if replica.state is ReplicaState.DRAINING:
                self._continue_drain(replica, now)

    async def _is_ready(self, replica: ManagedReplica) -> bool:
        assert self._client is not None
        try:
            response = await self._client.get(f"{replica.process.url}/ready")
            return response.status_code == 200
        except httpx.HTTPError:
            return False

    async def _health(self, replica: ManagedReplica) -> int | None:
        """The status /health answers; None for no answer (refused, timed out)."""
        assert self._client is not None
        try:
            return (await self._client.get(f"{replica.process.url}/health")).status_code
        except httpx.HTTPError:
            return None

    def _became_ready(self, replica: ManagedReplica, now: float) -> None:
        seconds = now - replica.started_at
        state = self.groups[replica.group]
        state.num_crashes = 0
        state.time_to_ready_s.append(seconds)
        spec = replica.spec
        logger.info("%s ready in %.1fs (release %d)", replica.replica_id, seconds, spec.release)
        if self.metrics is not None:
            self.metrics.time_to_capacity.labels(str(spec.release), spec.variant).observe(seconds)
        routed = self.count(replica.group, ReplicaState.READY)
        # A fixed-size group (the canary) routes every replica it has.
        wanted = routed < state.routable_wanted or state.policy is None
        if not wanted and spec == state.target:
            replica.state = ReplicaState.STANDBY  # nobody waits for it: into the warm pool
            logger.info("%s joins the warm pool", replica.replica_id)
            return
        self._route(replica, now, "cold")

    def _route(self, replica: ManagedReplica, now: float, source: str) -> None:
        """Into routing: a replica just ready (cold) or taken from the warm pool (warm).
        The time since routing fell short of what the autoscaler wants is the scale-out's
        time to capacity."""
        replica.state = ReplicaState.READY
        spec = replica.spec
        # Another model's releases are numbered apart: its label names the model too.
        release = str(spec.release) if spec.model is None else f"{spec.model}/{spec.release}"
        self.pool.add(replica.replica_id, replica.process.url, replica.group, release,
                      spec.variant)  # fmt: skip
        state = self.groups[replica.group]
        if state.short_since is not None:
            if self.metrics is not None:
                self.metrics.scale_out.labels(source).observe(now - state.short_since)
            if self.count(replica.group, ReplicaState.READY) >= state.routable_wanted:
                state.short_since = None

    def _replace(self, replica: ManagedReplica, now: float, why: str) -> None:
        """A live replica that cannot serve: kill it, then replace it like a crashed one."""
        logger.error("%s is ready but %s: replacing it", replica.replica_id, why)
        replica.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            replica.process.process.wait(timeout=5)  # SIGKILL: gone within milliseconds
        self._crashed(replica, now, why)

    def _crashed(self, replica: ManagedReplica, now: float, why: str | None = None) -> None:
        code = replica.process.process.poll()
        log_tail = replica.process.log_tail(10)
        logger.error(
            "%s exited with %s while %s; log tail:\n%s",
            replica.replica_id, code, replica.state, log_tail,
        )  # fmt: skip
        self.pool.remove(replica.replica_id)
        replica.process.close_log()
        self.replicas.remove(replica)
        state = self.groups[replica.group]
        state.num_crashes += 1
        state.num_failures += 1
        backoff = self.config.restart_backoff_s * 2 ** (state.num_crashes - 1)
        state.next_start_at = now + min(self.config.max_restart_backoff_s, backoff)
        if self.metrics is not None:
            self.metrics.replica_restarts.labels(str(replica.spec.release)).inc()
        if (
            replica.group == CANARY
            and replica.spec == state.target
            and state.num_failures >= self.config.max_canary_failures
            and self.on_canary_failed is not None
        ):
            last = why or f"exited with {code} while {replica.state}"
            said = _last_error(replica.process.log_tail(60))
            said = f"; its log says: {said}" if said else ""
            self.on_canary_failed(
                f"the canary's replicas failed {state.num_failures} times (last: {last}){said}"
            )

    def _retire_stale(self, group: Group, now: float) -> None:
        """Drain the group's replicas of a release it no longer serves: a starting one at
        once, the others once the target has a ready replica (they serve until then)."""
        target = self.groups[group].target
        stale = [
            r for r in self.replicas
            if r.group == group and r.spec != target and r.state is not ReplicaState.DRAINING
        ]  # fmt: skip
        if not stale:
            return
        target_ready = self.count(group, ReplicaState.READY) > 0
        for replica in stale:
            if target is None or target_ready or replica.state is ReplicaState.STARTING:
                self.drain(replica, now)

    def _desired(self, group: Group, now: float) -> int:
        """The replicas the group's routing wants: its policy's decision on its load."""
        state = self.groups[group]
        if state.target is None:
            return 0
        if state.policy is None:
            return state.fixed_replicas
        ready = self.count(group, ReplicaState.READY)
        # Starting replicas are capacity on its way only as far as they will be routed when
        # ready; those refilling the warm pool are not.
        starting = min(
            self.count(group, ReplicaState.STARTING), max(0, state.routable_wanted - ready)
        )
        decision = state.policy.decide(
            now,
            in_flight=self.pool.in_flight(group),
            ready_replicas=ready,
            starting_replicas=starting,
            time_to_ready_s=self.expected_time_to_ready_s(group),
        )
        if self.metrics is not None and group == STABLE:  # the gauges are the stable track's
            self.metrics.projected_in_flight.set(decision.projected_in_flight)
            self.metrics.expected_time_to_ready.set(decision.time_to_ready_s)
        return decision.desired_replicas

    def _scale(self, group: Group, desired: int, now: float) -> None:
        """Start or drain the group's replicas of its target toward `desired` in routing
        plus its warm pool."""
        state = self.groups[group]
        state.desired = state.routable_wanted = desired
        if state.short_since is None and self.count(group, ReplicaState.READY) < desired:
            state.short_since = now
        if state.target is not None:
            self._use_warm_pool(group, desired, now)
            desired += state.warm_pool  # kept started beyond what routing needs
        current = self.count(group, ReplicaState.STARTING, ReplicaState.READY, ReplicaState.STANDBY)
        if desired > current and state.target is not None and now >= state.next_start_at:
            for _ in range(desired - current):
                self.start(group, state.target)
            if self.metrics is not None and current > 0:
                self.metrics.scale_events.labels(group.label, "up").inc(desired - current)
        elif desired < current:
            candidates = sorted(
                (r for r in self.replicas
                 if r.group == group and r.spec == state.target
                 and r.state is not ReplicaState.DRAINING),
                key=lambda r: (r.state is ReplicaState.READY, r.state is ReplicaState.STANDBY,
                               self._in_flight(r)),
            )  # fmt: skip
            for replica in candidates[: current - desired]:
                self.drain(replica, now)
            if self.metrics is not None:
                self.metrics.scale_events.labels(group.label, "down").inc(current - desired)

    def _use_warm_pool(self, group: Group, routable_wanted: int, now: float) -> None:
        """Route warm replicas while routing has fewer than wanted; park idle routed ones
        while it has more and the warm pool is short (their requests all ended: no await
        between the check and leaving routing, so none can arrive in between)."""
        state = self.groups[group]
        mine = [r for r in self.replicas if r.group == group and r.spec == state.target]
        routed = [r for r in mine if r.state is ReplicaState.READY]
        warm = [r for r in mine if r.state is ReplicaState.STANDBY]
        for replica in warm[: max(0, routable_wanted - len(routed))]:
            logger.info("%s taken from the warm pool into routing", replica.replica_id)
            self._route(replica, now, "warm")
        excess = len(routed) - routable_wanted
        room = state.warm_pool - len(warm)
        idle = [r for r in routed if self._in_flight(r) == 0]
        for replica in idle[: max(0, min(excess, room))]:
            logger.info("%s leaves routing for the warm pool", replica.replica_id)
            self.pool.remove(replica.replica_id)
            replica.state = ReplicaState.STANDBY

    # Actions -----------------------------------------------------------------------------
    def start(self, group: Group, spec: ReleaseSpec) -> ManagedReplica:
        self._num_started += 1
        replica_id = f"replica-{self._num_started}"
        started_at = self.clock()
        process = self.launch(spec, replica_id)
        replica = ManagedReplica(replica_id, group, spec, process, started_at)
        self.replicas.append(replica)
        logger.info("starting %s (%s, release %d, %s) on %s", replica_id, group, spec.release,
                    spec.variant, process.url)  # fmt: skip
        return replica

    def drain(self, replica: ManagedReplica, now: float) -> None:
        """Out of routing now; SIGTERM when the gateway's requests there have ended."""
        logger.info("draining %s (%s, release %d)", replica.replica_id, replica.group,
                    replica.spec.release)  # fmt: skip
        replica.state = ReplicaState.DRAINING
        replica.drain_started_at = now
        self.pool.drain(replica.replica_id)
        self._continue_drain(replica, now)

    def _continue_drain(self, replica: ManagedReplica, now: float) -> None:
        assert replica.drain_started_at is not None
        overdue = now - replica.drain_started_at > self.config.drain_timeout_s
        if replica.process.has_exited():
            self.pool.remove(replica.replica_id)
            replica.process.close_log()
            self.replicas.remove(replica)
            logger.info("%s stopped", replica.replica_id)
        elif not replica.terminate_sent and (self._in_flight(replica) == 0 or overdue):
            replica.process.terminate()
            replica.terminate_sent = True
        elif overdue and now - replica.drain_started_at > 2 * self.config.drain_timeout_s:
            replica.process.kill()

    def _in_flight(self, replica: ManagedReplica) -> int:
        upstream = self.pool.get(replica.replica_id)
        return upstream.endpoint.in_flight if upstream is not None else 0

    async def shutdown(self) -> None:
        """Drain every replica and wait for all to exit (SIGKILL past the drain timeout)."""
        now = self.clock()
        for replica in list(self.replicas):
            if replica.state is not ReplicaState.DRAINING:
                self.drain(replica, now)
        while self.replicas:
            for replica in list(self.replicas):
                self._continue_drain(replica, self.clock())
            await asyncio.sleep(0.1)

    def snapshot(self, service) -> FleetSnapshot:
        """The gateway's snapshot with the supervisor's view of replicas (starting ones
        included, by state) and the desired replicas per group."""
        replicas: dict[tuple[str, str, str, str], int] = {}
        for r in self.replicas:
            state = str(r.state)
            upstream = self.pool.get(r.replica_id)
            if r.state is ReplicaState.READY and upstream is not None and not upstream.is_healthy:
                state = "unhealthy"  # ready once, failing its health checks now
            key = (r.group.label, str(r.spec.release), r.spec.variant, state)
            replicas[key] = replicas.get(key, 0) + 1
        desired = {group.label: s.desired for group, s in self.groups.items()}
        return dataclasses.replace(service.snapshot(), replicas=replicas, desired_replicas=desired)


def _last_error(log: str) -> str:
    """The log's last line naming an exception (`SomeError: why`), else its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\w(Error|Exception): ", line)]
    return (errors or lines or [""])[-1][:300]


def _release(spec: ReleaseSpec | None) -> str:
    return "none" if spec is None else str(spec.release)
