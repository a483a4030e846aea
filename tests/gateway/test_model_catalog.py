"""`ModelCatalog` (`gateway/models.py`) as pipeline.yaml's `models:` builds it: which model a
request's name and a pod's label give, and the config's checks of models and model tiers."""

from __future__ import annotations

import pytest

from modelship.config import ConfigError, ModelshipConfig
from modelship.gateway.groups import STABLE, Group, fallback_order, model_group
from modelship.gateway.models import ModelCatalog, UnknownLabel
from modelship.gateway.request import GatewayError


def two_models(**extra) -> ModelshipConfig:
    return ModelshipConfig.from_dict(
        {"name": "tiny", "models": [{"name": "tiny-b", "served_model_name": "b"}], **extra}
    )


def test_one_model_leaves_every_name_to_its_replicas() -> None:
    catalog = ModelshipConfig.from_dict({"name": "tiny"}).model_catalog()
    assert catalog.resolve("tiny") is None and catalog.resolve("some-adapter") is None
    assert catalog.model_of_label("anything") is None


def test_several_models_route_by_name_and_refuse_an_unknown_one() -> None:
    config = two_models(serve={"loras": {"sql": "/adapters/sql"}})
    catalog = config.model_catalog()
    assert catalog.names() == ["tiny", "b"]
    assert catalog.resolve("b") == "b"
    assert catalog.resolve("tiny") is None and catalog.resolve("sql") is None  # the primary's
    with pytest.raises(GatewayError) as error:
        catalog.resolve("gpt-9")
    assert error.value.status_code == 404 and error.value.code == "model_not_found"
    assert error.value.param == "model" and "`gpt-9`" in error.value.message
    # Pods by label: the render's DNS names.
    assert catalog.model_of_label("tiny-b") == "b" and catalog.model_of_label("tiny") is None
    with pytest.raises(UnknownLabel):
        catalog.model_of_label("other")


def test_a_model_served_twice_or_a_tier_of_an_unknown_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="served twice"):
        ModelshipConfig.from_dict({"name": "tiny", "models": [{"name": "tiny"}]})
    with pytest.raises(ConfigError, match="tier 'small' names model 'c'"):
        two_models(gateway={"tiers": [{"name": "small", "model": "c"}]})
    with pytest.raises(ConfigError, match="set one of `variant` and `model`"):
        two_models(gateway={"tiers": [{"name": "small", "model": "b", "variant": "int4"}]})
    config = two_models(gateway={"tiers": [{"name": "small", "model": "b"}]})
    assert config.gateway.variant_tiers == []  # no replicas of its own
    with pytest.raises(ValueError, match="label"):
        ModelCatalog(primary="a", others={"b": "x"}, primary_label="x")


def test_another_models_requests_fall_back_within_the_model_asked_for() -> None:
    other = model_group("b")
    assert fallback_order(other) == (other,)
    assert fallback_order(Group(STABLE.track, "primary", "b"), STABLE) == (other, STABLE)
    assert other.label == "b/stable" and STABLE.label == "stable"
