"""OpenAI API request and response models (pydantic); nothing else lives here."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from modelship.adapter_names import ADAPTER_NAME_PATTERN


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class StreamOptions(BaseModel):
    include_usage: bool = False


def lone_surrogate_path(data: Any) -> str | None:
    """The path (`messages.0.content`) of a string or key in `data` holding a lone
    surrogate, or None. JSON can spell one (`"\\ud800"`) and Python parses it, but it is no
    text: the tokenizer refuses it, and so does the UTF-8 encoder of any response that
    echoes it (the path itself is written with backslash escapes). Iterative: a body nested
    a thousand deep must not overflow the stack."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path
        elif isinstance(value, list):
            # type(), not isinstance: a token id prompt may list 100k ints (parsed JSON
            # holds exact types)
            stack += [(f"{path}.{i}", item) for i, item in enumerate(value)
                      if type(item) in _NESTED]  # fmt: skip
        elif isinstance(value, dict):
            for key, item in value.items():
                segment = str(key).encode("utf-8", "backslashreplace").decode()
                child = f"{path}.{segment}" if path else segment
                if not _is_text(str(key)):
                    return child
                stack.append((child, item))
    return None


_NESTED = (str, dict, list)


def _is_text(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's named schema. `strict` or not, the output
    follows the schema (a grammar cannot follow it loosely)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of these constrains the output."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Request(BaseModel):
    # Fields outside the spec are ignored, as OpenAI-compatible servers do (clients send
    # extras); what happens to each of the spec's is decided in `request_fields.py`.
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        path = lone_surrogate_path(data)
        if path is not None:
            raise PydanticCustomError(
                "lone_surrogate",
                "{path}: must be valid Unicode text (it holds a lone surrogate)",
                {"path": path or "body"},
            )
        return data

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    # token id (a string, as JSON keys are) -> a bias added to its logit, in [-100, 100]
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0  # extension: higher runs first
    # extension: prompt-lookup speculative decoding where the server has it on (None: the
    # server's default); the output is the same either way
    speculative: bool | None = None
    # extension: each streamed choice carries `token_ids`, the ids it generated (an event
    # is sent even when their text is held back), so a gateway can resume the stream
    return_token_ids: bool = False
    # extension: the ids this request already generated on a replica that died mid-stream
    # (streams with n=1 only): generation resumes after them, text and stop strings run on
    # across the cut, `max_tokens` counts them, and usage counts them as completion tokens
    resume_token_ids: list[int] | None = None
    # Structured outputs (server/structured_outputs.py): at most one of these is set
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension
    guided_json: dict[str, Any] | str | None = None  # vLLM's legacy spellings
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = "text"
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    """A call the model made (an assistant message's `tool_calls`, in answers and history)."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallOut] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    # the deprecated functions API's call in the history: refused (`request_fields`)
    function_call: Any = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Accepted without effect or refused unless they ask for nothing (`request_fields.py`);
    # declared so that a client's value is seen, not dropped as an unknown field.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None


def _prompt_form(prompt: Any) -> str:
    """Which of the prompt's forms to validate, from its first item: pydantic tries every
    member of a plain union and collects an error per item of each that fails (4 million
    token ids took seconds and a gigabyte that way)."""
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        return (
            "texts" if isinstance(first, str) else "id_lists" if isinstance(first, list) else "ids"
        )
    return "ids" if isinstance(prompt, list) else "text"


Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts")]
    | Annotated[list[int], Tag("ids")]
    | Annotated[list[list[int]], Tag("id_lists")],
    Discriminator(_prompt_form),
]


class CompletionRequest(_Request):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool = False
    # candidates generated per prompt; the `n` with the highest cumulative logprob return
    best_of: int | None = None
    # text after the completion (fill-in-the-middle): only models with FIM tokens take it
    suffix: str | None = None

    @property
    def num_prompts(self) -> int:
        """One for a text or a list of token ids; else one per item of the list."""
        prompt = self.prompt
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            return 1
        return len(prompt)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# Chat responses ----------------------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class _Reasoning(BaseModel):
    """A reasoning model's thinking (`server/reasoning.py`), under both names clients read;
    left out of the JSON when there is none."""

    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _without_absent_reasoning(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in ("reasoning_content", "reasoning"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatResponseMessage(_Reasoning):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """One call in a stream: sent whole here (id, name and all its arguments at once)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallDeltaFunction | None = None


class ChatDelta(_Reasoning):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with `return_token_ids` only


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


# Completion responses ----------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# Embeddings -------------------------------------------------------------------------------
class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    # a text, texts, token ids, or lists of token ids (as a completion's prompt)
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64 of little-endian float32 with encoding_format


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# Models and errors -------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "modelship"
    max_model_len: int | None = None
    parent: str | None = None  # a LoRA adapter's base model


class LoadLoRAAdapterRequest(BaseModel):
    """`POST /v1/load_lora_adapter` (vLLM's body)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(pattern=ADAPTER_NAME_PATTERN)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody

    @classmethod
    def of(cls, message: str, type_: str, param: str | None, code: Any) -> ErrorResponse:
        return cls(error=ErrorBody(message=message, type=type_, param=param, code=code))
