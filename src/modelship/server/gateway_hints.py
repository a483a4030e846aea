"""What a replica takes from its gateway beyond the OpenAI API, and from whom.

Per request the gateway sends its tenant's prefix-cache namespace and input cap as headers
and, for mid-stream failover, the `return_token_ids` / `resume_token_ids` body fields. Each
would let a client slip its tenant's limits if anyone could set it: name another tenant's
namespace and time its prompts, lift its own input cap, or hand in arbitrary token ids
(special tokens included) as output "already generated", outside both caps. So a replica
honours them only when it has an API key, which every request it serves then holds (the
gateway's, or an operator's). A replica without a key ignores the headers and refuses the
fields (400 naming the field): with no key, anyone could be sending them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from modelship.replica_headers import CACHE_SALT_HEADER, MAX_INPUT_TOKENS_HEADER
from modelship.server import protocol as p
from modelship.server.errors import BadRequestError


class InputTooLongError(BadRequestError):
    """A prompt over its tenant's `max_input_tokens`: the body the gateway answers itself
    when it knows the count (token-id prompts)."""

    def __init__(self, num_tokens: int, max_input_tokens: int) -> None:
        # The gateway's wording (gateway/tenants.py), so a client sees one refusal.
        super().__init__(
            f"the prompt has {num_tokens} tokens; this key allows at most {max_input_tokens}"
        )

    @property
    def code(self) -> str:
        return "input_too_long"


@dataclass(frozen=True)
class GatewayHints:
    """The gateway's per-request settings, as far as this replica trusts them."""

    is_trusted: bool  # the replica has a key (so the request held it)
    cache_salt: str | None = None
    max_input_tokens: int | None = None

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], has_api_key: bool) -> GatewayHints:
        if not has_api_key:
            return cls(is_trusted=False)
        raw = headers.get(MAX_INPUT_TOKENS_HEADER)
        cap = None
        if raw is not None:
            raw = raw.strip()
            if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
                raise BadRequestError(
                    f"{MAX_INPUT_TOKENS_HEADER}: must be a positive integer",
                    MAX_INPUT_TOKENS_HEADER,
                )
            cap = int(raw)
        return cls(is_trusted=True, cache_salt=headers.get(CACHE_SALT_HEADER), max_input_tokens=cap)

    def check_fields(self, request: p.ChatCompletionRequest | p.CompletionRequest) -> None:
        """Refuse the failover's fields from a request this replica cannot trust."""
        if self.is_trusted:
            return
        for name, value in (("resume_token_ids", request.resume_token_ids),
                            ("return_token_ids", request.return_token_ids or None)):  # fmt: skip
            if value is not None:
                raise BadRequestError(
                    f"{name}: set only by the modelship gateway's failover, which this "
                    "replica trusts only with its API key (serve.api_key); it has none",
                    name,
                )

    def check_input(self, num_tokens: int) -> None:
        """The tenant's input cap on the prompt as tokenized (resumed output not counted)."""
        if self.max_input_tokens is not None and num_tokens > self.max_input_tokens:
            raise InputTooLongError(num_tokens, self.max_input_tokens)
