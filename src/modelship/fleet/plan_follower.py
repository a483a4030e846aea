"""Following the release plan on storage: `modelship up` and every standalone gateway
replica read `models/<slug>/traffic.json` and the `production` link each second and apply
what they say, so `modelship release canary|promote|rollback`, run anywhere the storage is
mounted, reaches every gateway within a second or two, and a gateway that restarts comes
back to the plan rather than to the weight it was started with.

`PlanFollower` is the loop (one read, then `apply`, every `interval_s`; a plan that cannot
be read is logged and the last one kept). `standalone_canary_weight` is what a gateway that
does not manage its replicas (`modelship gateway`) makes of a plan: it cannot move its
replicas between tracks, so a promotion sends the canary track all traffic (its replicas
serve what is now production) until the stable track is redeployed with that release.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from modelship.release.traffic import TrafficPlan, read_traffic
from modelship.storage import Storage

logger = logging.getLogger(__name__)

# What the canary track gets after a promotion, where the gateway cannot retag replicas:
# every request while a canary replica is routable (the split falls back to stable else).
PROMOTED_WEIGHT = 100
_TRACK_ACTIONS = {"canary", "promote", "rollback", "auto_rollback", "production"}


def standalone_canary_weight(plan: TrafficPlan, production: int | None) -> int:
    """Percent of traffic to the canary track's replicas under `plan`: the canary's weight
    while one runs; `PROMOTED_WEIGHT` when the last change was the promotion of the release
    that is production now; else 0 (rolled back, or never a canary)."""
    if plan.canary is not None:
        return 0 if plan.canary.release == production else plan.canary.weight
    last = next((e for e in reversed(plan.events) if e.get("action") in _TRACK_ACTIONS), None)
    if last is not None and last["action"] == "promote" and last.get("release") == production:
        return PROMOTED_WEIGHT
    return 0


class PlanFollower:
    """Calls `apply` now (`sync`) and every `interval_s` while `run` runs."""

    def __init__(
        self,
        storage: Storage,
        slug: str,
        apply: Callable[[TrafficPlan, int | None], None],
        interval_s: float = 1.0,
    ) -> None:
        """`apply(plan, production)`: point the fleet at the plan and production release
        read from storage; an exception there is logged and the next tick tries again."""
        self.storage = storage
        self.slug = slug
        self.apply = apply
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None

    def sync(self) -> None:
        """Read the plan and apply it once; raises what reading or applying raised."""
        production = self.storage.production_release(self.slug)
        self.apply(read_traffic(self.storage, self.slug), production)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.sync()
            except Exception:  # a half-edited plan must not stop the fleet
                logger.exception("reading the release plan failed; keeping the current one")

    async def start(self) -> None:
        """Apply the plan before serving (a failure is logged: the loop retries), then
        follow it until `stop`."""
        try:
            self.sync()
        except Exception:
            logger.exception("reading the release plan failed; retrying every %ss",
                             self.interval_s)  # fmt: skip
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
