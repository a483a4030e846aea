"""Several models behind one gateway: which model a request's `model` field names.

A gateway serves its primary model (the one its config is about: `serve.served_model_name`,
else the model's slug) and, with `models:` in pipeline.yaml, more models beside it, each
run by replicas of its own (`groups.Group.model`). The catalog maps the names a request
may give to the model whose replicas serve it:

- one model (no `models:`): every name goes to the primary's replicas, which answer 404
  for a name they do not serve (their LoRA adapters included), as before there were
  several;
- several: the primary's name and its configured adapters (`serve.loras`) go to the
  primary, another model's name to that model, and any other name is refused here with
  the OpenAI 404 `model_not_found` naming it.

Pods found in the Kubernetes API say their model with the `modelship.io/model` label (the
render writes each model's DNS name there: a served name may hold characters a label may
not): `pod_labels` maps it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from modelship.gateway.request import GatewayError

MODEL_HEADER = "x-modelship-model"  # the model that answered


class UnknownLabel(ValueError):
    """A pod's `modelship.io/model` label names no model of the catalog."""


@dataclass(frozen=True)
class ModelCatalog:
    """The models one gateway serves. `primary`: the primary's served name (None: not known,
    a gateway given only addresses); `others`: each other model's served name -> its pods'
    `modelship.io/model` label; `primary_label`: the primary pods' label;
    `primary_adapters`: the adapter names the primary's replicas are started with."""

    primary: str | None = None
    others: Mapping[str, str] = field(default_factory=dict)
    primary_label: str | None = None
    primary_adapters: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.primary is not None and self.primary in self.others:
            raise ValueError(f"model {self.primary!r} is both the primary and another model")
        labels = list(self.others.values())
        for label in labels:
            if labels.count(label) > 1 or label == self.primary_label:
                raise ValueError(f"two models' pods carry the label {label!r}")

    @property
    def is_multi_model(self) -> bool:
        return bool(self.others)

    def names(self) -> list[str]:
        """Every model's served name, the primary first (where known)."""
        return [*([self.primary] if self.primary else []), *self.others]

    def resolve(self, name: str) -> str | None:
        """The model serving the requested `name` (None: the primary); raises the 404
        `model_not_found` for a name no model serves (see the module doc)."""
        if name in self.others:
            return name
        if not self.is_multi_model or name == self.primary or name in self.primary_adapters:
            return None
        raise GatewayError(404, f"The model `{name}` does not exist or you do not have "
                           "access to it.", "invalid_request_error", param="model",
                           code="model_not_found")  # fmt: skip

    def name_of(self, model: str | None, requested: str) -> str:
        """The served name of `model` (None: the primary's, else the name `requested`)."""
        return model if model is not None else (self.primary or requested)

    def model_of_label(self, label: str | None) -> str | None:
        """The model whose pods carry `label` (None, the primary's label, or any label when
        the gateway serves one model: the primary); raises `UnknownLabel`."""
        if label is None or label == self.primary_label or not self.is_multi_model:
            return None
        for name, other in self.others.items():
            if other == label:
                return name
        raise UnknownLabel(label)
