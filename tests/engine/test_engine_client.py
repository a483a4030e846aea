"""Both engine fronts satisfy `EngineClient`, the Protocol the server is written against:
every member exists, methods with the same signature and the same sync/async kind."""

from __future__ import annotations

import inspect

import pytest

from modelship.engine import AsyncLLMEngine, EngineClient, EngineCoreClient

MEMBERS = sorted(
    name
    for name, value in vars(EngineClient).items()
    if not name.startswith("_") and (callable(value) or isinstance(value, property))
)


def test_the_protocol_names_what_the_server_uses() -> None:
    assert {"add_request", "abort", "stats", "is_dead", "stalled_s", "shutdown"} <= set(MEMBERS)


@pytest.mark.parametrize("front", [AsyncLLMEngine, EngineCoreClient])
@pytest.mark.parametrize("name", MEMBERS)
def test_front_has_the_member_as_the_protocol_states_it(front: type, name: str) -> None:
    expected = inspect.getattr_static(EngineClient, name)
    if isinstance(expected, property):
        # A property, or an attribute set in __init__ (EngineCoreClient.tokenizer)
        actual = inspect.getattr_static(front, name, None)
        assert actual is None or isinstance(actual, property), f"{front.__name__}.{name}"
        if actual is None:
            assert f"self.{name} =" in inspect.getsource(front.__init__)
        return
    actual = inspect.getattr_static(front, name)
    assert inspect.iscoroutinefunction(actual) == inspect.iscoroutinefunction(expected)
    assert inspect.signature(actual) == inspect.signature(expected), f"{front.__name__}.{name}"
