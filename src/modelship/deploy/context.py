"""Everything a builder needs, resolved once from the config (names, paths, ports)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from modelship.config import ModelEntry, ModelshipConfig
from modelship.deploy.config import DeployConfig, ServingConfig
from modelship.deploy.names import dns_name, model_slug
from modelship.deploy.quantity import parse_quantity
from modelship.deploy.sizing import ServingSize, gib_quantity, model_config_path, size_replica


@dataclass(frozen=True)
class RenderContext:
    """Resolved names shared by the builders; one per render."""

    config: ModelshipConfig
    name: str  # prefix of every object name, a DNS-1035 label
    slug: str  # the model's folder under models/
    served_model_name: str
    # Another model served beside the config's own (`models:`); None: the config's own.
    model: ModelEntry | None = None
    # What one replica of the config's own model needs, from its config.json (`deploy.
    # sizing`); None where render cannot read one (a Hub source not yet acquired here).
    size: ServingSize | None = None

    def for_model(self, entry: ModelEntry) -> RenderContext:
        """The context of the engines of `entry`, another model behind the same gateway."""
        # Not sized: `size` is the config's own model's.
        return dataclasses.replace(self, slug=entry.name, served_model_name=entry.served_name,
                                   model=entry, size=None)  # fmt: skip

    @property
    def model_label(self) -> str:
        """Its pods' `modelship.io/model` label (`ModelshipConfig.model_catalog`'s)."""
        return self.name if self.model is None else dns_name(self.model.name)

    @property
    def engine_prefix(self) -> str:
        """What its engine objects' names and component labels begin with."""
        return self.name if self.model is None else f"{self.name}-{self.model_label}"

    @classmethod
    def from_config(cls, config: ModelshipConfig) -> RenderContext:
        slug = model_slug(config.source, config.name)
        return cls(
            config=config,
            name=config.deploy.name or dns_name(slug),
            slug=slug,
            served_model_name=config.serve.served_model_name or slug,
            size=_size(config, slug),
        )

    @property
    def deploy(self) -> DeployConfig:
        return self.config.deploy

    @property
    def serving(self) -> ServingConfig:
        """The serving section, its GPUs per pod raised to `serve.engine.
        tensor_parallel_size` (one GPU per rank) and to what the model needs (`size`) where
        those are larger, and its memory request and limit raised to the model's: the pod's
        resources, the chart's values and the engines' `--tensor-parallel-size` all follow."""
        serving = self.config.deploy.serving
        ranks = max(self.config.serve.engine.tensor_parallel_size,
                    self.size.num_gpus if self.size else 0)  # fmt: skip
        if serving.gpu is not None and serving.gpu.count < ranks:
            gpu = serving.gpu.model_copy(update={"count": ranks})
            serving = serving.model_copy(update={"gpu": gpu})
        if self.size is not None:
            resources = serving.resources
            requests = _at_least(resources.requests, self.size.host_memory_bytes)
            limits = _at_least(resources.limits, self.size.host_memory_limit_bytes)
            resources = resources.model_copy(update={"requests": requests, "limits": limits})
            serving = serving.model_copy(update={"resources": resources})
        return serving

    @property
    def namespace(self) -> str:
        return self.config.deploy.namespace

    @property
    def port(self) -> int:
        return self.config.serve.port

    @property
    def pvc_name(self) -> str:
        return self.config.deploy.storage.pvc_name

    @property
    def config_map_name(self) -> str:
        """The ConfigMap holding pipeline.yaml, mounted at /etc/modelship."""
        return f"{self.name}-config"

    @property
    def memo_cache_name(self) -> str:
        """Argo's memoization cache (a ConfigMap) for the acquire step."""
        return f"{self.name}-acquire-cache"

    @property
    def pipeline_service_account(self) -> str:
        return self.config.deploy.workflow.service_account or f"{self.name}-pipeline"

    @property
    def api_key_secret(self) -> str | None:
        """The Secret holding the API key, or None when the API is open."""
        if self.serving.api_key_secret:
            return self.serving.api_key_secret
        return f"{self.name}-api-key" if self.config.serve.api_key else None

    @property
    def renders_api_key_secret(self) -> bool:
        return self.serving.api_key_secret is None and self.config.serve.api_key is not None

    @property
    def metric_prefix(self) -> str:
        """Engine metric names are vLLM's with this prefix (see server/metrics.py)."""
        return "vllm:" if self.serving.engine == "vllm" else "modelship:"


def _size(config: ModelshipConfig, slug: str) -> ServingSize | None:
    """Sized from the base's config.json where render can read it; a checkpoint our engine
    cannot read (`ModelConfigError`) is not sized: the configured resources stand."""
    path = model_config_path(config, slug)
    if path is None:
        return None
    from modelship.model.config import ModelConfig, ModelConfigError

    try:
        model = ModelConfig.from_dir(path.parent)
    except ModelConfigError:
        return None
    return size_replica(config, model)


def _at_least(quantities: dict[str, str], memory: int) -> dict[str, str]:
    """`quantities` with `memory` raised to at least `memory` bytes."""
    current = quantities.get("memory")
    if current is not None and parse_quantity(current) >= memory:
        return quantities
    return {**quantities, "memory": gib_quantity(memory)}
