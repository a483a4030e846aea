"""The request's structured-output fields -> one `GrammarSpec` for the engine.

Accepted: OpenAI's `response_format` (`json_object`, `json_schema` strict or not; `text` is
no constraint) and vLLM's extensions: `structured_outputs` ({json, regex, choice, grammar,
json_object}) and the legacy `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. At most one constraint per request. Each is checked here (llguidance
validates it without the tokenizer), so a bad schema or an unsupported keyword is a 400
naming the field before the engine sees the request.
"""

from __future__ import annotations

import json
from typing import Any

from modelship.engine import GrammarSpec, InvalidParamsError
from modelship.server import protocol as p
from modelship.server.errors import BadRequestError


def grammar_spec(request: p.ChatCompletionRequest | p.CompletionRequest) -> GrammarSpec | None:
    """The constraint `request` asks for, checked; None for free text."""
    specs = [spec for spec in _specs(request) if spec is not None]
    if len(specs) > 1:
        names = ", ".join(spec.param for spec in specs)
        raise BadRequestError(f"only one structured output may be set; got {names}",
                              specs[1].param)  # fmt: skip
    if not specs:
        return None
    try:
        specs[0].check()
    except InvalidParamsError as exc:
        raise BadRequestError(str(exc), exc.param) from exc
    return specs[0]


def _specs(request: p.ChatCompletionRequest | p.CompletionRequest) -> list[GrammarSpec | None]:
    specs = [_response_format(request.response_format)]
    outputs = request.structured_outputs
    if outputs is not None:
        param = "structured_outputs"
        specs += [
            _json(outputs.json_, f"{param}.json"),
            _simple("regex", outputs.regex, f"{param}.regex"),
            _choice(outputs.choice, f"{param}.choice"),
            _simple("grammar", outputs.grammar, f"{param}.grammar"),
            GrammarSpec("json_object", "", f"{param}.json_object") if outputs.json_object else None,
        ]
    specs += [
        _json(request.guided_json, "guided_json"),
        _simple("regex", request.guided_regex, "guided_regex"),
        _choice(request.guided_choice, "guided_choice"),
        _simple("grammar", request.guided_grammar, "guided_grammar"),
    ]
    return specs


def _response_format(response_format: p.ResponseFormat | None) -> GrammarSpec | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec("json_object", "", "response_format")
    if response_format.json_schema is None:
        raise BadRequestError(
            "response_format: type json_schema needs a `json_schema` object", "response_format"
        )
    schema = response_format.json_schema.schema_
    if schema is None:  # OpenAI leaves it optional: any JSON object
        return GrammarSpec("json_object", "", "response_format")
    return GrammarSpec.json_schema(schema, "response_format")


def _json(schema: dict[str, Any] | str | None, param: str) -> GrammarSpec | None:
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise BadRequestError(f"{param}: not valid JSON ({exc})", param) from exc
        if not isinstance(schema, dict):
            raise BadRequestError(f"{param}: a JSON schema is an object", param)
    return GrammarSpec.json_schema(schema, param)


def _simple(kind: str, text: str | None, param: str) -> GrammarSpec | None:
    return None if text is None else GrammarSpec(kind, text, param)  # type: ignore[arg-type]


def _choice(choices: list[str] | None, param: str) -> GrammarSpec | None:
    return None if choices is None else GrammarSpec.choice(choices, param)
