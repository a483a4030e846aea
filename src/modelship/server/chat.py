"""`POST /v1/chat/completions`: whole responses and SSE streams."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from modelship.engine import EngineRequest
from modelship.server import protocol as p
from modelship.server import tool_calls
from modelship.server.gateway_hints import GatewayHints
from modelship.server.serving import SSE_DONE, WITHOUT_TOKEN_IDS, OpenAIServing, sse
from modelship.server.tool_calls import CallParser, ToolCall, ToolUse


async def create_chat_completion(
    serving: OpenAIServing, request: p.ChatCompletionRequest, hints: GatewayHints
) -> p.ChatCompletionResponse | AsyncIterator[str]:
    """Validate everything before the engine sees the request; errors raise `APIError`."""
    serving.check_request(request)
    hints.check_fields(request)
    lora = serving.adapter_of(request)
    use = serving.tool_use(request)
    prompt = await serving.chat_prompt(request, use)
    hints.check_input(len(prompt))
    resumed = serving.resumed_token_ids(request)  # only a stream resumes
    params = serving.sampling_params(request, len(prompt), len(resumed))
    request_id = p.random_id("chatcmpl")
    num_top = request.top_logprobs or 0
    engine_request = EngineRequest(
        request_id, prompt + resumed, params, request.priority, hints.cache_salt, lora
    )
    if request.stream:
        deltas = serving.generate(engine_request)
        first = await anext(deltas)  # admission errors surface here, before any byte is sent
        parsers = None
        if use is not None:  # a resumed stream's parsers go on from the text already sent
            parsers = [_resumed_parser(serving, use, resumed) for _ in range(request.n)]
        return _stream(
            serving, request, request_id, len(prompt), len(resumed), first, deltas, parsers
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
                **_answer(c.text, c.finish_reason, use),
            )
            for i, c in enumerate(choices)
        ],
        usage=p.Usage(
            prompt_tokens=len(prompt),
            completion_tokens=completion_tokens,
            total_tokens=len(prompt) + completion_tokens,
        ),
    )


def _answer(text: str, finish_reason: str | None, use: ToolUse | None) -> dict:
    """A whole choice's message and finish reason: with tools, the calls parsed out of the
    text (`finish_reason: "tool_calls"` when the model stopped after calling)."""
    if use is None:
        return {"message": p.ChatResponseMessage(content=text), "finish_reason": finish_reason}
    parsed = tool_calls.parse(text, use)
    if not parsed.calls:
        return {
            "message": p.ChatResponseMessage(content=parsed.content),
            "finish_reason": finish_reason,
        }
    message = p.ChatResponseMessage(
        content=parsed.content.strip() or None, tool_calls=[c.to_api() for c in parsed.calls]
    )
    return {"message": message, "finish_reason": _with_calls(finish_reason)}


def _with_calls(finish_reason: str | None) -> str | None:
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _resumed_parser(serving: OpenAIServing, use: ToolUse, resumed: list[int]) -> CallParser:
    """A parser fed the text a failed replica already streamed (its output discarded: the
    client has it), so a call cut in half is parsed whole and indices go on."""
    parser = CallParser(use)
    if resumed:
        parser.feed(serving.tokenizer.decode(resumed, skip_special_tokens=True))
    return parser


async def _stream(
    serving, request, request_id, num_prompt_tokens, num_resumed, first, deltas, parsers=None
):
    """A resumed stream (`num_resumed` > 0) goes on where the failed one stopped: no opening
    role chunk, and usage as one uninterrupted stream would have counted it. With tools
    (`parsers`, one per choice), calls are parsed out of the text as it streams."""
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
            text, calls = delta.text, []
            if parsers is not None:
                parser = parsers[delta.index]
                parsed = parser.feed(delta.text)
                if delta.finish_reason is not None:
                    rest = parser.flush()
                    parsed = tool_calls.Parsed(
                        parsed.content + rest.content, parsed.calls + rest.calls
                    )
                text, calls = parsed.content, parsed.calls
            if text or logprobs is not None or token_ids:
                yield chunk(
                    delta.index,
                    p.ChatDelta(content=text),
                    logprobs=logprobs,
                    token_ids=token_ids,
                )
            if calls:  # indices count the choice's calls from its first
                first_call = parsers[delta.index].num_calls - len(calls)  # type: ignore[index]
                for index, call in enumerate(calls, start=first_call):
                    yield chunk(delta.index, p.ChatDelta(tool_calls=[_call_delta(index, call)]))
            if delta.finish_reason is not None:
                finish = delta.finish_reason
                if parsers is not None and parsers[delta.index].num_calls:
                    finish = _with_calls(finish)
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
