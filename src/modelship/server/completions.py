"""`POST /v1/completions`: one or many prompts (text or token ids), whole or streamed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from modelship.engine import EngineRequest, SamplingParams
from modelship.server import protocol as p
from modelship.server.errors import BadRequestError
from modelship.server.gateway_hints import GatewayHints
from modelship.server.openai_translation import SSE_DONE, OpenAIServing, sse


async def create_completion(
    serving: OpenAIServing, request: p.CompletionRequest, hints: GatewayHints
) -> p.CompletionResponse | AsyncIterator[str]:
    serving.check_request(request)
    hints.check_fields(request)
    lora = serving.adapter_of(request)
    prompts = await serving.completion_prompts(request)
    hints.check_input(sum(len(prompt) for prompt in prompts))  # as the gateway counts them
    resumed = serving.resumed_token_ids(request)
    params = [serving.sampling_params(request, len(prompt), len(resumed)) for prompt in prompts]
    request_id = p.random_id("cmpl")

    def engine_request(engine_id: str, prompt: list[int], prm: SamplingParams) -> EngineRequest:
        return EngineRequest(engine_id, prompt, prm, request.priority, hints.cache_salt, lora)

    if request.stream:
        if len(prompts) != 1:
            raise BadRequestError("streaming supports one prompt per request", "prompt")
        deltas = serving.generate(engine_request(request_id, prompts[0] + resumed, params[0]))
        first = await anext(deltas)  # admission errors surface before any byte is sent
        return _stream(serving, request, request_id, prompts[0], len(resumed), first, deltas)

    # A task group, not gather: when one prompt fails, the others are cancelled (which
    # aborts their engine requests) instead of generating to the end for nobody.
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(serving.collect(engine_request(f"{request_id}-{i}", prompt, prm)))
                for i, (prompt, prm) in enumerate(zip(prompts, params, strict=True))
            ]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None  # the first error is the answer, as before
    results = [task.result() for task in tasks]
    # every candidate was generated: usage counts all of them, as OpenAI bills best_of
    completion_tokens = sum(len(c.token_ids) for per_prompt in results for c in per_prompt)
    choices = []
    for prompt_index, (prompt, candidates) in enumerate(zip(prompts, results, strict=True)):
        prefix = serving.tokenizer.decode(prompt) if request.echo else ""
        for i, choice in enumerate(_best(candidates, request.n)):
            logprobs = None
            if request.logprobs is not None:
                echoed = (prompt, choice.prompt_logprobs) if request.echo else None
                logprobs = serving.completion_logprobs(choice.logprobs, 0, echoed)
            choices.append(
                p.CompletionChoice(
                    index=prompt_index * request.n + i,
                    text=prefix + choice.text,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                )
            )
    num_prompt_tokens = sum(len(prompt) for prompt in prompts)
    return p.CompletionResponse(
        id=request_id,
        model=request.model,
        choices=choices,
        usage=p.Usage(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=num_prompt_tokens + completion_tokens,
        ),
    )


def _best(candidates: list, n: int) -> list:
    """The `n` candidates with the highest cumulative logprob (`best_of`, as vLLM ranks
    them), best first; all of them, in order, when there are only `n`."""
    if len(candidates) == n:
        return candidates
    return sorted(candidates, key=lambda c: sum(e.logprob for e in c.logprobs), reverse=True)[:n]


async def _stream(serving, request, request_id, prompt, num_resumed, first, deltas):
    """A resumed stream (`num_resumed` > 0) goes on where the failed one stopped, with
    usage as one uninterrupted stream would have counted it."""
    created = int(time.time())
    completion_tokens = num_resumed
    offsets = [0] * request.n

    def chunk(choice: p.CompletionChoice, token_ids: list[int] | None = None) -> str:
        response = p.CompletionResponse(
            id=request_id, created=created, model=request.model, choices=[choice]
        )
        payload = response.model_dump(exclude={"usage"})
        if request.return_token_ids:
            payload["choices"][0]["token_ids"] = token_ids
        return sse(payload)

    if request.echo:
        text = serving.tokenizer.decode(prompt)
        echoed = None
        if request.logprobs is not None and first.prompt_logprobs is not None:
            echoed = serving.completion_logprobs([], 0, (prompt, first.prompt_logprobs))
        for index in range(request.n):
            offsets[index] = len(text)
            yield chunk(
                p.CompletionChoice(index=index, text=text, logprobs=echoed, finish_reason=None)
            )

    # Closing this generator (the client went away) closes `deltas`, which aborts the
    # request in the engine and frees its blocks.
    async with aclosing(deltas):
        delta = first
        while delta is not None:
            completion_tokens += len(delta.token_ids)
            logprobs = None
            if request.logprobs is not None and delta.logprobs:
                logprobs = serving.completion_logprobs(delta.logprobs, offsets[delta.index])
            offsets[delta.index] += len(delta.text)
            token_ids = delta.token_ids if request.return_token_ids else None
            if delta.text or logprobs is not None or delta.finish_reason is not None or token_ids:
                yield chunk(
                    p.CompletionChoice(
                        index=delta.index,
                        text=delta.text,
                        logprobs=logprobs,
                        finish_reason=delta.finish_reason,
                    ),
                    token_ids,
                )
            delta = await anext(deltas, None)
    if request.stream_options and request.stream_options.include_usage:
        usage = p.Usage(
            prompt_tokens=len(prompt),
            completion_tokens=completion_tokens,
            total_tokens=len(prompt) + completion_tokens,
        )
        response = p.CompletionResponse(
            id=request_id, created=created, model=request.model, choices=[], usage=usage
        )
        yield sse(response)
    yield SSE_DONE
