"""`POST /v1/chat/completions`: whole responses and SSE streams."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from modelship.engine import EngineRequest
from modelship.server import protocol as p
from modelship.server.gateway_hints import GatewayHints
from modelship.server.serving import SSE_DONE, WITHOUT_TOKEN_IDS, OpenAIServing, sse
from modelship.server.structured_outputs import grammar_spec


async def create_chat_completion(
    serving: OpenAIServing, request: p.ChatCompletionRequest, hints: GatewayHints
) -> p.ChatCompletionResponse | AsyncIterator[str]:
    """Validate everything before the engine sees the request; errors raise `APIError`."""
    serving.check_request(request)
    hints.check_fields(request)
    lora = serving.adapter_of(request)
    constraint = grammar_spec(request)
    prompt = await serving.chat_prompt(request)
    hints.check_input(len(prompt))
    resumed = serving.resumed_token_ids(request)  # only a stream resumes
    params = serving.sampling_params(request, len(prompt), len(resumed))
    request_id = p.random_id("chatcmpl")
    num_top = request.top_logprobs or 0
    engine_request = EngineRequest(
        request_id, prompt + resumed, params, request.priority, hints.cache_salt, lora, constraint
    )
    if request.stream:
        deltas = serving.generate(engine_request)
        first = await anext(deltas)  # admission errors surface here, before any byte is sent
        return _stream(serving, request, request_id, len(prompt), len(resumed), first, deltas)
    choices = await serving.collect(engine_request)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return p.ChatCompletionResponse(
        id=request_id,
        model=request.model,
        choices=[
            p.ChatChoice(
                index=i,
                message=p.ChatResponseMessage(content=c.text),
                logprobs=serving.chat_logprobs(c.logprobs, num_top) if request.logprobs else None,
                finish_reason=c.finish_reason,
            )
            for i, c in enumerate(choices)
        ],
        usage=p.Usage(
            prompt_tokens=len(prompt),
            completion_tokens=completion_tokens,
            total_tokens=len(prompt) + completion_tokens,
        ),
    )


async def _stream(serving, request, request_id, num_prompt_tokens, num_resumed, first, deltas):
    """A resumed stream (`num_resumed` > 0) goes on where the failed one stopped: no opening
    role chunk, and usage as one uninterrupted stream would have counted it."""
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
            if delta.text or logprobs is not None or token_ids:
                yield chunk(
                    delta.index,
                    p.ChatDelta(content=delta.text),
                    logprobs=logprobs,
                    token_ids=token_ids,
                )
            if delta.finish_reason is not None:
                yield chunk(delta.index, p.ChatDelta(), finish_reason=delta.finish_reason)
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
