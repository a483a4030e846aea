"""`GrammarSpec`: what a request's output must match (structured outputs), as a small
frozen value that pickles over the core pipe; `check` validates it without a tokenizer,
so the server refuses a bad schema (400 naming its field) before the engine sees it.
The engine compiles it (`engine.structured`). No torch here: the server imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
from llguidance import LLMatcher

from modelship.engine.sampling_params import InvalidParamsError

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
# Whitespace allowed between JSON tokens: enough to pretty-print a few levels deep, never an
# endless run (a weak model under a JSON grammar otherwise may emit spaces until max_tokens).
# A schema's own "x-guidance" options override it.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. `spec`: the JSON schema as canonical JSON text
    (json_schema), "" (json_object: any JSON object), a regex, a JSON list of strings
    (choice), or a Lark or GBNF grammar. `param` names the request field it came from, so
    an error about it names that field."""

    kind: GrammarKind
    spec: str
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidParamsError(self.param, f"unknown grammar kind {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any], param: str = "response_format") -> GrammarSpec:
        """Keys stay in the client's order: the output's properties follow the schema's
        `properties` order (as OpenAI's do), so sorting them would change the grammar."""
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def choice(cls, choices: list[str], param: str = "guided_choice") -> GrammarSpec:
        return cls("choice", json.dumps(list(choices)), param)

    def grammar(self) -> str:
        """The llguidance grammar text (not yet checked; `check` does that)."""
        options = {"whitespace_pattern": JSON_WHITESPACE}
        try:
            if self.kind == "json_schema":
                return LLMatcher.grammar_from_json_schema(self.spec, defaults=options)
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.spec)
            if self.kind == "choice":
                return llguidance.grammar_from("choice", self.spec)
            return llguidance.grammar_from("grammar", self.spec)
        except ValueError as exc:
            raise InvalidParamsError(self.param, f"{self.param}: {exc}") from exc

    def check(self) -> None:
        """Raise `InvalidParamsError` naming `param` for a grammar llguidance refuses (a bad
        regex, an unsupported JSON-schema keyword). Needs no tokenizer: the server runs it
        before the engine sees the request."""
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise InvalidParamsError(self.param, f"{self.param}: a non-empty list of "
                                         "non-empty strings")  # fmt: skip
        error = LLMatcher.validate_grammar(self.grammar())
        if error:
            raise InvalidParamsError(self.param, f"{self.param}: {error.strip()}")
