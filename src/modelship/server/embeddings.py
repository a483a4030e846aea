"""`POST /v1/embeddings`: each input's final hidden states, pooled and L2-normalized.

An embedding is a prefill-only request through the same scheduler as generation (batched
with it, chunked, preemptible): `SamplingParams.pooling` makes the runner pool the prompt's
hidden states as they are computed (`engine.model_runner`), and its one sampled token is
dropped. Pooling follows the model folder (`embedding_shape.py`, read at start-up): a
sentence-transformers `1_Pooling/config.json` asking for mean pooling gets "mean", anything
else the last token's state ("last", what decoder embedding models such as e5-mistral and
gte-Qwen use). Mean pooling reads every prompt position, so such a request shares no cached
prefix (a salt of its own); the last token is always computed, so "last" keeps the tenant's
prefix cache.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import uuid

from modelship.engine import EngineRequest, SamplingParams
from modelship.server import protocol as p
from modelship.server.errors import BadRequestError
from modelship.server.gateway_hints import GatewayHints
from modelship.server.openai_translation import OpenAIServing


async def create_embedding(
    serving: OpenAIServing, request: p.EmbeddingRequest, hints: GatewayHints
) -> p.EmbeddingResponse:
    serving.check_model(request.model)
    size = serving.embedding_shape.dimensions
    if request.dimensions is not None and request.dimensions != size:
        raise BadRequestError(
            f"dimensions: this model's embeddings have {size} dimensions and cannot be "
            "shortened (it was not trained for it); leave dimensions out",
            "dimensions",
        )
    prompts = await _prompts(serving, request.input)
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise BadRequestError(f"input: item {i} is empty", "input")
        if len(prompt) >= serving.max_model_len:  # the one sampled token needs a slot
            raise BadRequestError(
                f"input: item {i} has {len(prompt)} tokens; this model takes at most "
                f"{serving.max_model_len - 1} per input",
                "input",
            )
    if len(prompts) > serving.limits.max_prompts:
        raise BadRequestError(f"input: at most {serving.limits.max_prompts} inputs", "input")
    hints.check_input(sum(len(prompt) for prompt in prompts))
    pooling = serving.embedding_shape.pooling
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
    lora = None if request.model == serving.model_name else request.model
    request_id = uuid.uuid4().hex[:24]
    engine_requests = [
        EngineRequest(
            f"embd-{request_id}-{i}",
            prompt,
            params,
            cache_salt=f"embd-{request_id}-{i}" if pooling == "mean" else hints.cache_salt,
            lora=lora,
        )
        for i, prompt in enumerate(prompts)
    ]
    results = await asyncio.gather(*(serving.collect(r) for r in engine_requests))
    format_ = request.encoding_format
    data = [
        p.Embedding(index=i, embedding=_encoded(_normalized(choices[0].embedding or []), format_))
        for i, choices in enumerate(results)
    ]
    num_tokens = sum(len(prompt) for prompt in prompts)
    usage = p.EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    return p.EmbeddingResponse(data=data, model=request.model, usage=usage)


async def _prompts(serving: OpenAIServing, given: object) -> list[list[int]]:
    """Token ids of each input: a text, texts, token ids or lists of token ids."""
    if isinstance(given, str):
        return await serving.encode([given])
    items = list(given)  # type: ignore[call-overload]
    if not items:
        raise BadRequestError("input: at least one input is required", "input")
    if items and all(isinstance(t, int) for t in items):
        return [items]
    if all(isinstance(t, str) for t in items):
        return await serving.encode(items)
    return [list(ids) for ids in items]


def _normalized(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # what the openai SDK asks for by default
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector
