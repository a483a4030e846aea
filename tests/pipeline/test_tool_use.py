"""Tool-call success, select's quality metric for tool use: the shipped set is consistent,
argument matching is as documented, the engine path scores real calls, and a variant that
loses tool calls loses quality share."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from modelship.engine import EngineConfig, LLMEngine
from modelship.pipeline.select.intervals import quality_share
from modelship.pipeline.select.tool_use import (
    ToolTask,
    _is_expected,
    load_tool_tasks,
    load_toolbox,
    score_tool_calls,
)


def test_the_shipped_set_names_real_tools_and_arguments() -> None:
    tasks, toolbox = load_tool_tasks(), load_toolbox()
    assert len(tasks) == 40 and len({t.id for t in tasks}) == 40
    for task in tasks:
        assert task.name in task.tools and set(task.tools) <= toolbox.keys(), task.id
        properties = toolbox[task.name]["function"]["parameters"]["properties"]
        assert set(task.arguments) <= properties.keys(), task.id


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"city": "paris"}', True),  # case
        ('{"city": "Paris", "unit": "celsius"}', True),  # an extra optional argument
        ('{"city": "Lyon"}', False),
        ('{"unit": "celsius"}', False),  # the expected one missing
        ('{"city": "the city of Paris"}', True),  # holds every expected word
    ],
)
def test_arguments_match_by_value_not_by_spelling(arguments: str, expected: bool) -> None:
    task = ToolTask("t", "?", ("get_weather",), "get_weather", {"city": "Paris"})
    assert _is_expected("get_weather", arguments, task) is expected
    assert not _is_expected("search_web", arguments, task)


def test_numbers_and_expressions() -> None:
    task = ToolTask("t", "?", ("calculate",), "calculate", {"expression": "12*7"})
    assert _is_expected("calculate", '{"expression": "12 * 7"}', task)
    money = ToolTask("m", "?", ("convert_currency",), "convert_currency", {"amount": 100})
    assert _is_expected("convert_currency", '{"amount": 100.0}', money)
    assert not _is_expected("convert_currency", '{"amount": "100"}', money)


def test_the_engine_path_scores_the_calls_the_grammar_leaves(tiny_llama_dir: Path) -> None:
    """With one tool whose only argument has one allowed value, the grammar leaves exactly
    one call: it succeeds where that call is expected and fails where another is."""
    toolbox = {
        "pick": {"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "properties": {"color": {"enum": ["red"]}},
            "required": ["color"]}}},
    }  # fmt: skip
    tasks = [
        ToolTask("right", "Pick a color.", ("pick",), "pick", {"color": "red"}),
        ToolTask("wrong", "Pick a color.", ("pick",), "pick", {"color": "blue"}),
    ]
    engine = LLMEngine(tiny_llama_dir, EngineConfig(max_model_len=1024))
    assert score_tool_calls(engine, tasks, toolbox) == [True, False]
    assert not engine.has_unfinished()


def test_a_variant_that_loses_tool_calls_loses_quality_share() -> None:
    base = {"task_accuracy": 0.5, "nll_per_token": math.log(10.0), "tool_call_success": 0.6}
    broken = {**base, "tool_call_success": 0.3}
    assert quality_share(dict(base), base, with_tools=True) == pytest.approx(1.0)
    assert quality_share(broken, base, with_tools=True) == pytest.approx((1.0 + 1.0 + 0.5) / 3)
    no_tools = {**base, "tool_call_success": 0.0}
    assert quality_share(broken, no_tools, with_tools=False) == pytest.approx(1.0)
    # on a resample where the base calls nothing right there is no scale: kept whole
    assert quality_share(broken, no_tools, with_tools=True) == pytest.approx(1.0)
