"""The headers the gateway adds to a request for its replicas, beyond the OpenAI API.

One owner for each name: the gateway (`gateway/forwarding.py`) writes them and the replica
(`server/gateway_hints.py`) reads them, both importing them from here, so the two sides
cannot drift apart. A replica trusts them only with its API key (`gateway_hints.py` says
why). The request id, which a client may send too, is `request_id.REQUEST_ID_HEADER`.
"""

from __future__ import annotations

# The tenant's prefix-cache namespace (an opaque string): equal prefixes are shared only
# within it.
CACHE_SALT_HEADER = "x-modelship-cache-salt"
# The tenant's `max_input_tokens`, checked by the replica on the prompt's real token count.
MAX_INPUT_TOKENS_HEADER = "x-modelship-max-input-tokens"
