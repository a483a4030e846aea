"""`POST /v1/chat/completions`: whole responses and SSE streams.

Each choice's text goes through a `ChoiceReader`: a reasoning model's thinking is split off
first (`reasoning.py`), then, with tools, calls are parsed out of the rest
(`tool_calls.py`); what remains is the content.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from modelship.engine import EngineRequest
from modelship.engine.grammar_spec import GrammarSpec
from modelship.engine.sampling_params import InvalidParamsError
from modelship.server import protocol as p
from modelship.server import tool_calls
from modelship.server.errors import BadRequestError
from modelship.server.gateway_hints import GatewayHints
from modelship.server.openai_translation import SSE_DONE, WITHOUT_TOKEN_IDS, OpenAIServing, sse
from modelship.server.reasoning import ReasoningSplitter, Split
from modelship.server.structured_outputs import grammar_spec
from modelship.server.tool_calls import CallParser, ToolCall, ToolUse


async def create_chat_completion(
    serving: OpenAIServing, request: p.ChatCompletionRequest, hints: GatewayHints
) -> p.ChatCompletionResponse | AsyncIterator[str]:
    """Validate everything before the engine sees the request; errors raise `APIError`."""
    serving.check_request(request)
    hints.check_fields(request)
    lora = serving.adapter_of(request)
    use = serving.tool_use(request)
    constraint = _constraint(use, request)
    prompt = await serving.chat_prompt(request, use)
    hints.check_input(len(prompt))
    resumed = serving.resumed_token_ids(request)  # only a stream resumes
    params = serving.sampling_params(request, len(prompt), len(resumed))
    request_id = p.random_id("chatcmpl")
    num_top = request.top_logprobs or 0
    engine_request = EngineRequest(
        request_id, prompt + resumed, params, request.priority, hints.cache_salt, lora, constraint
    )

    def reader() -> ChoiceReader:
        return ChoiceReader(serving.reasoning_splitter(prompt), CallParser(use) if use else None)

    if request.stream:
        deltas = serving.generate(engine_request)
        first = await anext(deltas)  # admission errors surface here, before any byte is sent
        readers = [reader() for _ in range(request.n)]
        if resumed:  # a resumed stream's readers go on from the text already sent
            sent = serving.tokenizer.decode(resumed, skip_special_tokens=True)
            for each in readers:
                each.feed(sent)  # the client has it: dropped
        return _stream(
            serving, request, request_id, len(prompt), len(resumed), first, deltas, readers
        )
    choices = await serving.collect(engine_request)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return p.ChatCompletionResponse(
        id=request_id,
        model=request.model,
        choices=[
            p.ChatChoice(
                index=i,
                logprobs=serving.chat_logprobs(c.logprobs, num_top) if request.logprobs else None,
                **reader().whole(c.text, c.finish_reason),
            )
            for i, c in enumerate(choices)
        ],
        usage=p.Usage(
            prompt_tokens=len(prompt),
            completion_tokens=completion_tokens,
            total_tokens=len(prompt) + completion_tokens,
        ),
    )


def _constraint(use: ToolUse | None, request: p.ChatCompletionRequest) -> GrammarSpec | None:
    """What the answer must follow: calls, with `tool_choice` "required" or a named tool
    (a `response_format` then has no text to shape); calls or the JSON of a JSON
    `response_format` with "auto"; else the structured output asked for, if any."""
    spec = tool_calls.forced_calls(use, request.tool_choice) if use is not None else None
    if spec is None:
        spec = grammar_spec(request)  # checked: a bad schema is a 400 naming its field
        if spec is None or use is None:
            return spec
        spec = tool_calls.calls_or_json(use, spec)
    try:
        spec.check()
    except InvalidParamsError as exc:
        raise BadRequestError(
            f"tools: a parameters schema this server cannot enforce: {exc}", "tools"
        ) from exc
    return spec


@dataclass
class Read:
    """What a piece of a choice's text holds."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def delta(self) -> p.ChatDelta:
        """A piece of content, of reasoning, or of both (content None in a reasoning-only
        one)."""
        reasoning = self.reasoning or None
        content = self.content if self.content or reasoning is None else None
        return p.ChatDelta(content=content, reasoning_content=reasoning, reasoning=reasoning)


class ChoiceReader:
    """One choice's text, piece by piece: thinking split off (`splitter`, None for a model
    that does not reason), then tool calls parsed out (`parser`, None without tools)."""

    def __init__(self, splitter: ReasoningSplitter | None, parser: CallParser | None) -> None:
        self.splitter = splitter
        self.parser = parser

    @property
    def num_calls(self) -> int:
        return self.parser.num_calls if self.parser is not None else 0

    def feed(self, text: str) -> Read:
        split = Split(content=text) if self.splitter is None else self.splitter.feed(text)
        return self._parse(split)

    def finish(self) -> Read:
        """The held-back tails, once the choice ended."""
        read = self._parse(Split() if self.splitter is None else self.splitter.finish())
        if self.parser is not None:
            rest = self.parser.flush()
            read.content += rest.content
            read.calls += rest.calls
        return read

    def whole(self, text: str, finish_reason: str | None) -> dict:
        """A whole choice's `message` and `finish_reason` (`"tool_calls"` when the model
        stopped after calling)."""
        first, rest = self.feed(text), self.finish()
        reasoning = (first.reasoning + rest.reasoning) or None
        content = first.content + rest.content
        calls = first.calls + rest.calls
        message = p.ChatResponseMessage(
            content=(content.strip() or None) if calls else content,
            tool_calls=[call.to_api() for call in calls] or None,
            reasoning_content=reasoning,
            reasoning=reasoning,
        )
        return {"message": message, "finish_reason": self.finish_reason(finish_reason)}

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" and self.num_calls else finish_reason

    def _parse(self, split: Split) -> Read:
        if self.parser is None or not split.content:
            return Read(split.reasoning, split.content)
        parsed = self.parser.feed(split.content)
        return Read(split.reasoning, parsed.content, parsed.calls)


async def _stream(
    serving, request, request_id, num_prompt_tokens, num_resumed, first, deltas, readers
):
    """A resumed stream (`num_resumed` > 0) goes on where the failed one stopped: no opening
    role chunk, and usage as one uninterrupted stream would have counted it. `readers`: per
    choice, what its text holds (reasoning, content, tool calls: each call is one delta)."""
    created = int(time.time())
    num_top = request.top_logprobs or 0
    exclude = None if request.return_token_ids else WITHOUT_TOKEN_IDS

    def chunk(index: int, delta: p.ChatDelta, **fields) -> str:
        choice = p.ChatStreamChoice(index=index, delta=delta, **fields)
        return sse(
            p.ChatCompletionChunk(
                id=request_id, created=created, model=request.model, choices=[choice]
            ),
            exclude,
        )

    def calls(index: int, read: Read) -> list[str]:
        first_call = readers[index].num_calls - len(read.calls)  # indices count from the first
        return [
            chunk(index, p.ChatDelta(tool_calls=[_call_delta(number, call)]))
            for number, call in enumerate(read.calls, start=first_call)
        ]

    if not num_resumed:
        for index in range(request.n):
            yield chunk(index, p.ChatDelta(role="assistant", content=""))
    completion_tokens = num_resumed

    # Closing this generator (the client went away) closes `deltas`, which aborts the
    # request in the engine and frees its blocks.
    async with aclosing(deltas):
        delta = first
        while delta is not None:
            completion_tokens += len(delta.token_ids)
            logprobs = None
            if request.logprobs and delta.logprobs:
                logprobs = serving.chat_logprobs(delta.logprobs, num_top)
            token_ids = delta.token_ids if request.return_token_ids else None
            reader = readers[delta.index]
            read = reader.feed(delta.text)
            if read.content or read.reasoning or logprobs is not None or token_ids:
                yield chunk(delta.index, read.delta(), logprobs=logprobs, token_ids=token_ids)
            for call in calls(delta.index, read):
                yield call
            if delta.finish_reason is not None:
                rest = reader.finish()
                if rest.content or rest.reasoning:  # a held-back tail that was no tag or call
                    yield chunk(delta.index, rest.delta())
                for call in calls(delta.index, rest):
                    yield call
                finish = reader.finish_reason(delta.finish_reason)
                yield chunk(delta.index, p.ChatDelta(), finish_reason=finish)
            delta = await anext(deltas, None)
    if request.stream_options and request.stream_options.include_usage:
        usage = p.Usage(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=num_prompt_tokens + completion_tokens,
        )
        yield sse(
            p.ChatCompletionChunk(
                id=request_id, created=created, model=request.model, choices=[], usage=usage
            ),
            exclude,
        )
    yield SSE_DONE


def _call_delta(index: int, call: ToolCall) -> p.ToolCallDelta:
    function = p.ToolCallDeltaFunction(name=call.name, arguments=call.arguments)
    return p.ToolCallDelta(index=index, id=call.id, type="function", function=function)
