"""`pipeline.yaml`: one config for the local run, the fleet and the Kubernetes rendering.

Every section has defaults, so an empty file (or none) runs the demo model. Unknown keys
are errors, and every error names the field it is about (`select.weights.speed: ...`).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from modelship.deploy.config import DeployConfig
from modelship.deploy.names import dns_name, model_slug
from modelship.fleet.config import AutoscaleConfig
from modelship.gateway.config import GatewayConfig
from modelship.gateway.models import ModelCatalog
from modelship.serve_options import ReplicaOptions, ServeOptions
from modelship.tracing import TracingConfig


class ConfigError(ValueError):
    """The config file is missing, is not YAML, or has invalid fields (named)."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OptimizeConfig(Section):
    variants: list[str] = Field(default_factory=lambda: ["fp16", "awq", "gptq"], min_length=1)
    max_parallel: int | None = Field(default=None, ge=1)  # None: one per core
    # Per-variant overrides of the scheme's default recipe, e.g. {awq: {num_calibration_samples: 8}}
    recipes: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("variants")
    @classmethod
    def _known_variants(cls, variants: list[str]) -> list[str]:
        from modelship.pipeline.optimize.schemes import supported_schemes

        supported = supported_schemes()
        for name in variants:
            if name not in supported:
                raise ValueError(f"unknown variant {name!r}; supported: {', '.join(supported)}")
        if len(set(variants)) != len(variants):
            raise ValueError("variants must not repeat")
        return variants


class GatesConfig(Section):
    min_quality_share: float = Field(default=0.9, gt=0, le=1)
    max_repetition: float = Field(default=0.5, ge=0, le=1)
    min_printable: float = Field(default=0.95, ge=0, le=1)


class SelectConfig(Section):
    preset: Literal["default", "chat", "batch", "quality-critical"] = "default"
    weights: dict[Literal["quality", "latency", "throughput", "memory"], float] = Field(
        default_factory=dict
    )
    gates: GatesConfig = Field(default_factory=GatesConfig)
    # Quality: held-out perplexity, agreement and KL against the base, the task set.
    eval_chunks: int = Field(default=8, ge=1)
    eval_chunk_tokens: int = Field(default=256, ge=16)
    # The standard multiple-choice set (`pipeline/select/benchmark_data.py`: BIG-bench tasks
    # fetched by `make data` into <storage>/cache/eval, scored like lm-eval); its acc_norm
    # retention joins the quality share. Empty leaves it out. The first `benchmark_items`.
    benchmark_tasks: list[str] = Field(default_factory=list)
    benchmark_items: int = Field(default=2000, ge=1)
    # Serving: the same streaming workload for every variant.
    latency_requests: int = Field(default=4, ge=1)
    concurrency: int = Field(default=8, ge=1)
    throughput_requests: int = Field(default=16, ge=1)
    prompt_tokens: int = Field(default=128, ge=1)
    output_tokens: int = Field(default=32, ge=1)
    # The workload above is one round; rounds interleave the variants and repeat until every
    # serving metric's 95% interval is within `ci_target` of its mean (after `min_rounds`,
    # which always run), or `max_rounds` or `serving_budget_s` ends them. Differences inside
    # the intervals, or under `min_effect` of the value, are ties (`pipeline/select/stats.py`).
    min_rounds: int = Field(default=3, ge=2)
    max_rounds: int = Field(default=8, ge=2)
    ci_target: float = Field(default=0.05, gt=0)
    serving_budget_s: float = Field(default=240.0, gt=0)
    min_effect: float = Field(default=0.03, ge=0, lt=1)

    @model_validator(mode="after")
    def _rounds_in_order(self) -> SelectConfig:
        if self.max_rounds < self.min_rounds:
            raise ValueError(
                f"max_rounds ({self.max_rounds}) must be >= min_rounds ({self.min_rounds})"
            )
        return self

    @field_validator("weights")
    @classmethod
    def _non_negative(cls, weights: dict[str, float]) -> dict[str, float]:
        for group, weight in weights.items():
            if weight < 0:
                raise ValueError(f"weight of {group} must be >= 0, got {weight}")
        return weights


class ServeConfig(ReplicaOptions):
    """The replicas' options (`serve_options.ReplicaOptions`: the name, engine, adapters,
    grace period, stall timeout) and the address and key of one `modelship serve`."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    api_key: str | None = None


class RetryConfig(Section):
    """Per-step retry policy for transient errors (network, a killed worker)."""

    max_attempts: int = Field(default=3, ge=1)
    backoff_s: float = Field(default=2.0, ge=0)
    max_backoff_s: float = Field(default=30.0, ge=0)


class ModelEntry(Section):
    """One more model served beside the config's own (`models:`): a model already on the
    same storage with a production release (`modelship run` with that model made it), run
    by replicas of its own behind the same gateway."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # its slug
    served_model_name: str | None = None  # what requests name it; None: its slug
    # Its replicas' autoscaling; None: the top-level `autoscale:`.
    autoscale: AutoscaleConfig | None = None

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.name


class ModelshipConfig(Section):
    source: str = "demo"  # a Hub repo id, a local folder, a .gguf file, or "demo"
    revision: str | None = None
    name: str | None = None  # the model's slug under models/ (default: from the source)
    storage: Path = Path("modelship-data")
    optimize: OptimizeConfig = Field(default_factory=OptimizeConfig)
    select: SelectConfig = Field(default_factory=SelectConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    retries: RetryConfig = Field(default_factory=RetryConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    deploy: DeployConfig = Field(default_factory=DeployConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)  # gateway and replicas
    log_format: Literal["text", "json"] = "text"  # json: one object per line, with trace ids
    # More models behind the same gateway (`gateway/models.py`): requests pick one by their
    # `model` field; `gateway.tiers` may send requests to one of them (a model tier).
    models: list[ModelEntry] = Field(default_factory=list)

    @model_validator(mode="after")
    def _models_distinct(self) -> ModelshipConfig:
        self.model_catalog()  # raises ValueError naming the model served twice
        return self

    def model_catalog(self, slug: str | None = None) -> ModelCatalog:
        """The models the gateway serves: this config's own (its model is `slug`, else the
        one `source`/`name` give) and `models:`. Their pods' labels are the render's."""
        slug = slug or model_slug(self.source, self.name)
        primary = self.serve.served_model_name or slug
        names = [entry.served_name for entry in self.models]
        slugs = [slug, *(entry.name for entry in self.models)]
        for name in names:
            if names.count(name) > 1 or name == primary:
                raise ValueError(f"models: the model name {name!r} is served twice")
        for other in slugs:
            if slugs.count(other) > 1:
                raise ValueError(f"models: the model {other!r} is listed twice")
        for tier in self.gateway.tiers:
            if tier.model is not None and tier.model not in names:
                raise ValueError(
                    f"gateway.tiers: tier {tier.name!r} names model {tier.model!r}; models "
                    f"served beside {primary!r} (`models:`): {', '.join(names) or 'none'}"
                )
        return ModelCatalog(
            primary=primary,
            others={entry.served_name: dns_name(entry.name) for entry in self.models},
            primary_label=self.deploy.name or dns_name(slug),
            primary_adapters=frozenset(self.serve.loras),
        )

    def replica_options(self, **fields: Any) -> ServeOptions:
        """What each replica of this config is started with (`modelship up`, the pods):
        `serve`'s replica options, the gateway's request caps (a replica refusing what the
        gateway let through would be a 400 nobody can explain), the log format and tracing;
        `fields` set the rest (the variant, the served name) or override these."""
        serve = {name: getattr(self.serve, name) for name in ReplicaOptions.model_fields}
        caps = self.gateway.request_limits.model_dump(include=set(ServeOptions.model_fields))
        logs = {"log_format": self.log_format, "tracing": self.tracing}
        return ServeOptions(**(serve | caps | logs | fields))

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "config") -> ModelshipConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_errors(exc, origin)) from None

    @classmethod
    def load(cls, path: Path | None, **overrides: Any) -> ModelshipConfig:
        """Read `path` (None: all defaults), then apply non-None top-level overrides."""
        data: dict[str, Any] = {}
        origin = "config"
        if path is not None:
            origin = str(path)
            try:
                loaded = yaml.safe_load(Path(path).read_text())
            except FileNotFoundError:
                raise ConfigError(f"{path}: no such config file") from None
            except yaml.YAMLError as exc:
                raise ConfigError(f"{path}: not valid YAML: {exc}") from None
            if loaded is not None and not isinstance(loaded, dict):
                raise ConfigError(f"{path}: the top level must be a mapping of sections")
            data = loaded or {}
        data.update({key: value for key, value in overrides.items() if value is not None})
        return cls.from_dict(data, origin)


def format_errors(exc: ValidationError, origin: str) -> str:
    """One line per error, naming the field; an unknown key gets the nearest known one."""
    lines = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = unknown_key_message(error["loc"], message)
        lines.append(f"{origin}: {field}: {message}")
    return "\n".join(lines)


def unknown_key_message(loc: tuple, message: str) -> str:
    """`message` with "did you mean `select`?" where a known key of the same section is
    close to the unknown one (`selct`)."""
    known = _keys_at(ModelshipConfig, loc[:-1])
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    if close:
        return f"{message}; did you mean `{close[0]}`?"
    return f"{message} (known keys here: {', '.join(known)})" if known else message


def _keys_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys of the section of `model` at `loc` (list indexes and mapping keys
    skipped), or [] where no section of known keys is there."""
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None:
            return []
        field = current.model_fields.get(str(part))
        if field is None:
            continue  # a list index or a mapping's key: the section below is the same model's
        current = _model_in(field.annotation)
    return list(current.model_fields) if current is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (itself, or inside Optional, list, dict)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
