"""The request id a client may choose (`x-request-id`), checked before anything uses it.

The gateway sends it on to a replica as a header and writes it into logs and spans: a
non-ASCII one made httpx fail to build the replica's request (a 500, and the client's
keep-alive connection reset), and any string could be a megabyte or forge a log line. An
id is 1-128 characters of `[A-Za-z0-9._:-]` (a UUID, a ULID, a trace id all fit); anything
else is replaced with a new one.
"""

from __future__ import annotations

import re
import uuid

REQUEST_ID_HEADER = "x-request-id"
_VALID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def is_valid_request_id(value: str) -> bool:
    return _VALID.fullmatch(value) is not None


def request_id_from(header: str | None) -> str:
    """The client's id if valid, else a new one."""
    if header is not None and is_valid_request_id(header):
        return header
    return uuid.uuid4().hex
