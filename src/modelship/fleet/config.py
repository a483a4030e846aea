"""The `autoscale:` section of pipeline.yaml: a leaf (pydantic and the pure policy only),
so reading a config never imports the supervisor's processes and HTTP clients."""

from __future__ import annotations

from pydantic import Field

from modelship.autoscale.policy import AutoscalerConfig


class AutoscaleConfig(AutoscalerConfig):
    """The `autoscale:` section: the policy's settings plus how replicas are run."""

    scale_down_window_s: float = Field(default=60.0, ge=0)
    tick_s: float = Field(default=0.5, gt=0)
    replica_start_timeout_s: float = Field(default=300.0, gt=0)
    restart_backoff_s: float = Field(default=1.0, ge=0)
    max_restart_backoff_s: float = Field(default=30.0, ge=0)
    drain_timeout_s: float = Field(default=60.0, gt=0)
    # A ready replica whose /health answers 503 (its engine died or stalled) is replaced
    # at once; one that answers nothing at all (a hung process) after this long.
    max_unresponsive_s: float = Field(default=30.0, gt=0)
    canary_replicas: int = Field(default=1, ge=1)
    # Replicas kept started and ready but out of routing, per autoscaled group (the stable
    # track and each cheaper tier): a scale-out takes one of them into routing at once (no
    # model load on the request path) and starts a new one to refill the pool. They cost
    # memory, not compute: an idle engine does no work.
    warm_pool: int = Field(default=0, ge=0)
    # The canary is rolled back once its replicas have failed this many times (exited,
    # or replaced as dead or hung), whether or not one ever became ready.
    max_canary_failures: int = Field(default=3, ge=1)
