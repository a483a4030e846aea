"""The `deploy:` section of pipeline.yaml: how the pipeline and service run on Kubernetes.

Everything has a default, so `modelship deploy render` works on an empty config: the demo
model, CPU pods, a Deployment + HPA. Each check here exists because the API server (or
Knative, or the HPA controller) would otherwise reject the object later, or accept it and
misbehave, far from the line of YAML that caused it.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from modelship.deploy.names import DNS_1035_LABEL, DNS_1123_LABEL, MAX_NAME_LENGTH
from modelship.deploy.quantity import parse_quantity

_GO_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$")
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def _quantity(value: object) -> str:
    """YAML reads `cpu: 2` as an int; Kubernetes wants the string, so accept both."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"expected a quantity such as 500m or 8Gi, got {value!r}")
    text = str(value)
    if parse_quantity(text) < 0:  # raises QuantityError (a ValueError) naming the value
        raise ValueError(f"{text!r} is negative")
    return text


Quantity = Annotated[str, BeforeValidator(_quantity)]


def _dns_label(value: str, max_length: int = 63, *, letter_first: bool = False) -> str:
    pattern = DNS_1035_LABEL if letter_first else DNS_1123_LABEL
    if len(value) > max_length or not pattern.match(value):
        first = "a letter" if letter_first else "a letter or digit"
        raise ValueError(
            f"{value!r} must be a DNS label: lowercase letters, digits and '-', "
            f"starting with {first}, at most {max_length} characters"
        )
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Section):
    """Container requests and limits, by resource name (`cpu`, `memory`, `nvidia.com/gpu`)."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)

    @field_validator("limits")
    @classmethod
    def _limits_cover_requests(cls, limits: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        requests = info.data.get("requests", {})
        for resource, limit in limits.items():
            if resource in requests and parse_quantity(limit) < parse_quantity(requests[resource]):
                raise ValueError(
                    f"{resource} limit {limit} is below its request {requests[resource]}"
                )
        return limits


class Toleration(_Section):
    key: str
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None

    @field_validator("value")
    @classmethod
    def _value_only_with_equal(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("operator") == "Exists":
            raise ValueError("a toleration with operator Exists must not have a value")
        return value


def _gpu_tolerations() -> list[Toleration]:
    return [Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")]


class GpuConfig(_Section):
    """GPUs for one kind of pod: the count (a limit) and where such nodes are."""

    count: int = Field(default=1, ge=1)  # raised by render to what the model needs
    # One GPU's memory: render raises `count` until the model's share fits (`deploy.sizing`)
    memory: Quantity = "80Gi"
    resource: str = "nvidia.com/gpu"
    # Required node affinity: each label must have this value (GPU feature discovery's label
    # by default; e.g. `nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3` to pin a model).
    node_labels: dict[str, str] = Field(default_factory=lambda: {"nvidia.com/gpu.present": "true"})
    tolerations: list[Toleration] = Field(default_factory=_gpu_tolerations)

    @field_validator("node_labels")
    @classmethod
    def _valid_labels(cls, node_labels: dict[str, str]) -> dict[str, str]:
        for key, value in node_labels.items():
            if not _LABEL_KEY.match(key):
                raise ValueError(f"{key!r} is not a valid label key")
            if len(value) > 63 or not _LABEL_VALUE.match(value):
                raise ValueError(f"{value!r} (label {key}) is not a valid label value")
        return node_labels


class StepConfig(_Section):
    """One pipeline step's pod: resources and, optionally, GPUs."""

    resources: Resources = Field(default_factory=Resources)
    gpu: GpuConfig | None = None


def _step(cpu: str, memory: str, max_memory: str) -> StepConfig:
    return StepConfig(
        resources=Resources(requests={"cpu": cpu, "memory": memory}, limits={"memory": max_memory})
    )


class WorkflowConfig(_Section):
    """The Argo Workflow that runs acquire -> optimize (parallel) -> select -> deploy."""

    parallelism: int = Field(default=3, ge=1)  # pods of this workflow running at once
    # Acquire is memoized on model + revision; a cached entry older than this is ignored.
    memoize_max_age: str = "720h"
    # Exit codes a stage uses for transient failures (75 is EX_TEMPFAIL); pod-level errors
    # (eviction, node loss) are always retried, other failures never.
    transient_exit_codes: list[int] = Field(default_factory=lambda: [75])
    service_account: str | None = None  # None: `<name>-pipeline`, rendered with its RBAC
    # The final step applies serving.yaml; off when Helm or GitOps owns the serving objects.
    deploy_step: bool = True
    acquire: StepConfig = Field(default_factory=lambda: _step("1", "2Gi", "8Gi"))
    optimize: StepConfig = Field(default_factory=lambda: _step("2", "8Gi", "32Gi"))
    select: StepConfig = Field(default_factory=lambda: _step("2", "8Gi", "16Gi"))

    @field_validator("memoize_max_age")
    @classmethod
    def _go_duration(cls, value: str) -> str:
        if not _GO_DURATION.match(value):
            raise ValueError(f"{value!r} is not a duration such as 24h, 90m or 1h30m")
        return value

    @field_validator("transient_exit_codes")
    @classmethod
    def _exit_codes(cls, codes: list[int]) -> list[int]:
        for code in codes:
            if not 1 <= code <= 255:
                raise ValueError(f"exit code {code} is not in 1..255")
        return codes


class CanaryConfig(_Section):
    """Send `weight` percent of traffic to `releases/<release>`, the rest to the stable one."""

    release: int = Field(ge=1)
    weight: int = Field(ge=1, le=99)
    replicas: int = Field(default=1, ge=1)  # deployment serving only; KServe autoscales it


class GatewayConfig(_Section):
    replicas: int = Field(default=2, ge=1)
    port: int = Field(default=8080, ge=1, le=65535)
    resources: Resources = Field(
        default_factory=lambda: Resources(
            requests={"cpu": "250m", "memory": "256Mi"}, limits={"memory": "1Gi"}
        )
    )


class ServingConfig(_Section):
    """How the winner is served: KServe (Knative) or Deployment + HPA/KEDA, which engine."""

    kind: Literal["kserve", "deployment"] = "deployment"
    autoscaler: Literal["hpa", "keda"] = "hpa"  # deployment serving only
    engine: Literal["ours", "vllm"] = "ours"
    vllm_image: str = "vllm/vllm-openai:v0.33.0"
    # None serves `production` (what select published); a number pins `releases/<n>`,
    # which is how a rollback is rendered.
    release: int | None = Field(default=None, ge=1)
    min_replicas: int = Field(default=1, ge=1)  # at least one warm replica: no cold starts
    max_replicas: int = Field(default=4, ge=1)
    target_concurrency: int = Field(default=8, ge=1)  # in-flight requests per replica
    target_waiting: int = Field(default=2, ge=1)  # queued requests per replica (HPA)
    scale_up_stabilization_s: int = Field(default=0, ge=0, le=3600)
    scale_down_stabilization_s: int = Field(default=300, ge=0, le=3600)
    # preStop sleep: endpoints stop routing to a terminating pod before it starts draining.
    drain_delay_s: int = Field(default=5, ge=0, le=300)
    request_timeout_s: int = Field(default=600, ge=1)  # KServe: the longest stream
    max_unavailable: int = Field(default=1, ge=1)  # PodDisruptionBudget
    resources: Resources = Field(
        default_factory=lambda: Resources(
            requests={"cpu": "2", "memory": "4Gi"}, limits={"memory": "8Gi"}
        )
    )
    gpu: GpuConfig | None = Field(default=None, validate_default=True)
    canary: CanaryConfig | None = None
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"  # KEDA queries it
    # An existing Secret with key `api-key`; None renders one when serve.api_key is set.
    api_key_secret: str | None = None

    @field_validator("max_replicas")
    @classmethod
    def _max_at_least_min(cls, max_replicas: int, info: ValidationInfo) -> int:
        min_replicas = info.data.get("min_replicas", 1)
        if max_replicas < min_replicas:
            raise ValueError(f"max_replicas {max_replicas} is below min_replicas {min_replicas}")
        return max_replicas

    @field_validator("gpu")
    @classmethod
    def _vllm_needs_gpu(cls, gpu: GpuConfig | None, info: ValidationInfo) -> GpuConfig | None:
        if gpu is None and info.data.get("engine") == "vllm":
            raise ValueError("engine vllm needs a gpu: the vllm/vllm-openai image is CUDA-only")
        return gpu

    @field_validator("canary")
    @classmethod
    def _canary_differs(
        cls, canary: CanaryConfig | None, info: ValidationInfo
    ) -> CanaryConfig | None:
        if canary is not None and canary.release == info.data.get("release"):
            raise ValueError(f"canary release {canary.release} is already the stable release")
        return canary


class StorageConfig(_Section):
    """The PersistentVolumeClaim that is the storage root of every stage."""

    pvc_name: str = "modelship-data"
    size: Quantity = "100Gi"
    storage_class: str | None = None  # None: the cluster's default class
    # Parallel optimize pods and every serving replica mount it, possibly on different nodes.
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = "ReadWriteMany"

    @field_validator("pvc_name")
    @classmethod
    def _pvc_name(cls, value: str) -> str:
        return _dns_label(value)


class DeployConfig(_Section):
    namespace: str = "modelship"
    # cluster.yaml starts with the Namespace object; false where the namespace is managed
    # elsewhere (applying a Namespace needs a cluster-scoped permission).
    create_namespace: bool = True
    image: str = "ghcr.io/modelship/modelship:0.1.0"
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    name: str | None = None  # prefix of every object name; None: from the model slug
    storage: StorageConfig = Field(default_factory=StorageConfig)
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        return _dns_label(value)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return None if value is None else _dns_label(value, MAX_NAME_LENGTH, letter_first=True)
