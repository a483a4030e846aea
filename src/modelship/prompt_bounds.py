"""The length bounds of a completion's `prompt` list, checked before any of its items is
read: the gateway (`gateway/request.py`) and the replica (`server/token_limit.py`) both
ask here, and each answers in its own words.

A prompt list is one prompt of token ids (its first item an id) or a list of prompts
(strings or token-id lists). More prompts than `max_prompts`, or a token-id list longer
than `max_token_ids`, is over a bound: counting them costs nothing, validating millions
of ids one by one cost seconds.
"""

from __future__ import annotations

from enum import StrEnum


class PromptBound(StrEnum):
    PROMPTS = "prompts"  # more prompts than `max_prompts`
    TOKEN_IDS = "token_ids"  # a token-id list longer than `max_token_ids`


def exceeded_bound(prompt: list, max_prompts: int, max_token_ids: int | None) -> PromptBound | None:
    """The first bound `prompt` is over, None if none (`max_token_ids` None: unbounded)."""
    if not prompt:
        return None
    is_one_prompt = not isinstance(prompt[0], str | list)
    if not is_one_prompt and len(prompt) > max_prompts:
        return PromptBound.PROMPTS
    if max_token_ids is None:
        return None
    lists = [prompt] if is_one_prompt else [item for item in prompt if isinstance(item, list)]
    if any(len(ids) > max_token_ids for ids in lists):
        return PromptBound.TOKEN_IDS
    return None
