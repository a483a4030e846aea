"""Autoscaling: a pure policy (desired replicas from load) that controllers act on.

The local controller starts and drains replica processes; on Kubernetes the same config
is rendered as HPA/KEDA settings. The policy itself never touches a process.
"""

from modelship.autoscale.policy import (
    AutoscalerConfig,
    AutoscalerPolicy,
    ScaleDecision,
    ScaleReason,
)

__all__ = ["AutoscalerConfig", "AutoscalerPolicy", "ScaleDecision", "ScaleReason"]
