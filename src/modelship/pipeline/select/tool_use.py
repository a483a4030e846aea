"""Tool-call success: does a variant call the right tool with the right arguments?

The set (`tool_tasks.jsonl`, 40 requests over the 8 tools of `tool_tools.json`) asks for
one call each and offers two or three tools. Each request goes through the chat template
with its tools exactly as the server renders them (`server.tool_calls`), and is answered
greedily under the `tool_choice: "required"` grammar: the call is always well formed, so
what is measured is the model's choice of tool and of argument values. A call succeeds
when its name is the expected one and every expected argument matches (numbers equal;
text equal once spaces and case are ignored, or holding every expected word). Quantizing
a model that calls tools well can break exactly this while perplexity barely moves.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelship.engine import EngineRequest, LLMEngine, SamplingParams
from modelship.server import protocol as p
from modelship.server.tool_calls import (
    ToolUse,
    detect_format,
    forced_calls,
    parse,
    template_messages,
)

TOOL_TASKS_PATH = Path(__file__).with_name("tool_tasks.jsonl")
TOOLBOX_PATH = Path(__file__).with_name("tool_tools.json")
MAX_CALL_TOKENS = 96  # the longest expected call is ~40 tokens in the demo tokenizer


@dataclass(frozen=True)
class ToolTask:
    id: str
    prompt: str
    tools: tuple[str, ...]
    name: str
    arguments: dict[str, Any]


def load_tool_tasks(path: Path = TOOL_TASKS_PATH) -> list[ToolTask]:
    tasks = []
    for line in path.read_text().splitlines():
        if line.strip():
            data = json.loads(line)
            tasks.append(ToolTask(data["id"], data["prompt"], tuple(data["tools"]),
                                  data["name"], data["arguments"]))  # fmt: skip
    return tasks


def load_toolbox(path: Path = TOOLBOX_PATH) -> dict[str, dict[str, Any]]:
    """Tool name -> its OpenAI tool object."""
    return {
        name: {"type": "function", "function": {"name": name, **spec}}
        for name, spec in json.loads(path.read_text()).items()
    }


def score_tool_calls(
    engine: LLMEngine, tasks: list[ToolTask], toolbox: dict[str, dict[str, Any]] | None = None
) -> list[bool]:
    """Whether each task's greedy, grammar-held call is the expected one."""
    toolbox = toolbox or load_toolbox()
    tokenizer = engine.tokenizer
    form = detect_format(tokenizer.get_chat_template(None, tools=[]))
    uses = {}
    for task in tasks:
        use = uses[task.id] = ToolUse([toolbox[name] for name in task.tools], form, False)
        messages = template_messages([p.ChatMessage(role="user", content=task.prompt)], use)
        text = tokenizer.apply_chat_template(
            messages,
            tools=use.tools if use.in_template else None,
            tokenize=False,
            add_generation_prompt=True,
        )
        prompt = list(tokenizer(text, add_special_tokens=False).input_ids)
        params = SamplingParams(max_tokens=MAX_CALL_TOKENS, temperature=0.0)
        engine.add(EngineRequest(f"tool-{task.id}", prompt, params,
                                 constraint=forced_calls(use, "required")))  # fmt: skip
    texts = {f"tool-{task.id}": "" for task in tasks}
    while engine.has_unfinished():
        for delta in engine.step():
            texts[delta.request_id] += delta.text
    results = []
    for task in tasks:
        calls = parse(texts[f"tool-{task.id}"], uses[task.id]).calls
        results.append(bool(calls) and _is_expected(calls[0].name, calls[0].arguments, task))
    return results


def _is_expected(name: str, arguments: str, task: ToolTask) -> bool:
    if name != task.name:
        return False
    given = json.loads(arguments)
    return all(key in given and _same(given[key], value) for key, value in task.arguments.items())


def _same(given: Any, expected: Any) -> bool:
    if isinstance(expected, bool) or not isinstance(expected, int | float | str):
        return given == expected
    if isinstance(expected, int | float):
        return isinstance(given, int | float) and not isinstance(given, bool) and given == expected
    if not isinstance(given, str):
        return False
    if re.sub(r"\s+", "", given).casefold() == re.sub(r"\s+", "", expected).casefold():
        return True
    words = set(re.findall(r"[\w@.+*/-]+", given.casefold()))
    return set(re.findall(r"[\w@.+*/-]+", expected.casefold())) <= words
