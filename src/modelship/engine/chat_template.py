"""Chat templates rendered the way transformers renders them, without importing transformers.

A chat template is a Jinja template over `messages`, `tools`, `documents`,
`add_generation_prompt` and the tokenizer's special tokens (`bos_token`, `eos_token`...).
Templates on the Hub are written against transformers' environment, so this one matches it:
sandboxed and immutable, `trim_blocks` and `lstrip_blocks`, `break`/`continue` in loops, a
`tojson` filter that keeps non-ASCII text and escapes no HTML, the globals
`raise_exception(message)` and `strftime_now(format)`, and the `{% generation %}` block
(it marks assistant text for training masks; here it renders its body unchanged).
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: renders what it encloses, in its own scope."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; prompts need the text as it is.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_chat_template(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


# Appended to the message being continued, so its end can be found in the rendered text. It
# ends in a space: a template that strips message text strips that too, and then the message's
# own trailing whitespace is stripped as well, as a plain render of the template would.
_CONTINUE_MARK = "MODELSHIP_CONTINUE_FINAL_MESSAGE "


def render_chat_template(
    template: jinja2.Template,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    variables: dict[str, Any] | None = None,
) -> str:
    """One conversation as prompt text. `variables` (special tokens, template options such as
    `enable_thinking`) are visible to the template. With `continue_final_message` (True for
    "content", or the field's name), the text ends where the last message's text ends, with
    nothing the template puts after it, so the model continues that message."""
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise TypeError("tools must be JSON schemas (dicts)")
    if documents is not None and not all(isinstance(doc, dict) for doc in documents):
        raise TypeError("documents must be dicts (with 'title' and 'text' keys)")
    field = None
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = messages[-1].get(field)
        if not isinstance(final, str):
            raise ValueError(f"continue_final_message: the last message has no text {field!r}")
        messages = copy.deepcopy(messages)
        messages[-1][field] = final + _CONTINUE_MARK
    text = template.render(
        messages=messages,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **(variables or {}),
    )
    if field is None:
        return text
    at = text.rfind(_CONTINUE_MARK.rstrip())
    if at == -1:
        raise ValueError("continue_final_message: the template dropped the last message's text")
    if text.startswith(_CONTINUE_MARK, at):
        return text[:at]
    return text[:at].rstrip()
