"""Every field of OpenAI's chat and text completion request bodies, and what this server
does with it: implements it, accepts it without effect, or refuses it with a 400 whose
`param` names it. Nothing of the spec is silently ignored: a client that asks for tools or
audio and got plain text back as if it had not asked would take it for the answer.

The spec is the openai SDK's `ChatCompletionCreateParams` and `CompletionCreateParams`
(openai 3.57; tests/server/test_request_fields.py fails when the SDK adds a field, so the
new one is decided here). Fields outside the spec are ignored, as OpenAI-compatible servers
do (SDKs and frameworks send their own extras), except the vLLM extensions listed in
`VLLM_EXTRAS` and modelship's own in `MODELSHIP_EXTRAS`, which are implemented.

A refused field is allowed when its value asks for nothing (`functions: []`,
`function_call: "none"` or `"auto"`, `store: false`, `modalities: ["text"]`...): SDKs and
frameworks send those by default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from modelship.server import protocol as p
from modelship.server.errors import BadRequestError

CHAT_SPEC_FIELDS = frozenset({
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "moderation", "n", "parallel_tool_calls", "prediction", "presence_penalty",
    "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning_effort",
    "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
    "verbosity", "web_search_options",
})  # fmt: skip
COMPLETION_SPEC_FIELDS = frozenset({
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
    "suffix", "temperature", "top_p", "user",
})  # fmt: skip

# Implemented as OpenAI documents them. `suffix` only on models with fill-in-the-middle
# tokens (`fim.py`; a 400 naming it on other models); `best_of` ranks by cumulative logprob.
IMPLEMENTED = frozenset({
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
    "logprobs", "top_logprobs", "stream", "stream_options", "echo", "best_of", "suffix",
    "tools", "tool_choice", "parallel_tool_calls",  # tool calling: `tool_calls.py`
})  # fmt: skip

# Accepted and without effect here; why each is harmless.
ACCEPTED = {
    "user": "an end-user id for abuse tracking (the gateway also keys sessions on it)",
    "safety_identifier": "an end-user id for abuse tracking",
    "metadata": "tags for stored completions; nothing is stored (see `store`)",
    "service_tier": "every request runs on the one tier this server has",
    "prompt_cache_key": "a cache-routing hint; the gateway routes by prompt prefix already",
    "prompt_cache_retention": "a cache lifetime hint; the prefix cache evicts by LRU",
    "prompt_cache_options": "a cache hint; the prefix cache works without it",
    "prediction": "predicted output only saves latency; the output is the same without it",
}

# Structured outputs: implemented in their own module (issue 30 section 1); until it
# lands here, ignored as before.
ELSEWHERE = frozenset({"response_format"})


@dataclass(frozen=True)
class Refusal:
    """A spec field this server does not implement: 400 unless `asks_nothing(value)`."""

    reason: str
    asks_nothing: Callable[[Any], bool] = lambda value: value is None


def _empty(value: Any) -> bool:
    return value is None or value == []


def _free_choice(value: Any) -> bool:
    # "auto" asks for nothing without tools (and with tools, `tools` is refused first)
    return value in (None, "none", "auto")


_FUNCTIONS_REASON = "the deprecated functions API; use tools and tool_choice"

REFUSED: dict[str, Refusal] = {
    "functions": Refusal(_FUNCTIONS_REASON, _empty),
    "function_call": Refusal(_FUNCTIONS_REASON, _free_choice),
    "audio": Refusal("this server generates text only"),
    "modalities": Refusal("this server generates text only", lambda v: v in (None, ["text"])),
    "store": Refusal("this server stores no completions", lambda v: v in (None, False)),
    "reasoning_effort": Refusal("this server has no reasoning-effort control"),
    "verbosity": Refusal("this server has no verbosity control"),
    "web_search_options": Refusal("this server has no web search"),
    "moderation": Refusal("this server runs no moderation"),
}

# vLLM's extra fields this server implements (others of vLLM's are ignored).
VLLM_EXTRAS = frozenset({
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens",
    "add_generation_prompt",
})  # fmt: skip
# modelship's own: `priority` (higher runs first: vLLM's order is the reverse),
# `speculative`, and the gateway failover's `return_token_ids` / `resume_token_ids`.
MODELSHIP_EXTRAS = frozenset({"priority", "speculative", "return_token_ids", "resume_token_ids"})


def refuse_unsupported(request: p.ChatCompletionRequest | p.CompletionRequest) -> None:
    """Raise `BadRequestError` naming the first refused field the request asks for."""
    # sorted, `tools` after `tool_choice`: a request with both is refused naming the choice
    for name in sorted(request.model_fields_set & REFUSED.keys()):
        refusal = REFUSED[name]
        if not refusal.asks_nothing(getattr(request, name)):
            raise BadRequestError(f"{name} is not supported by this server ({refusal.reason})",
                                  name)  # fmt: skip
    if isinstance(request, p.ChatCompletionRequest):
        for i, message in enumerate(request.messages):
            if not _empty(message.function_call):
                raise BadRequestError(
                    f"messages.{i}.function_call is not supported by this server "
                    f"({_FUNCTIONS_REASON})",
                    f"messages.{i}.function_call",
                )
