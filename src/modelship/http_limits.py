"""A cap on the HTTP request head (request line + headers) for the server and the gateway.

httptools (uvicorn's fast parser, which both servers run on) has no limit of its own: it
holds a header until its end arrives, growing it by concatenation, so one 48 MiB header
cost the gateway 100 MB and 2.8 s of CPU before authentication could refuse it, and a few
such connections exhausted memory. The head is counted as it streams in
(`httptools_limited.HeadLimitedHttpToolsProtocol`): past `MAX_HEAD_BYTES` the client gets
431 with an OpenAI error body and the connection is closed, before the parser ever holds
more than the cap. Without httptools, uvicorn runs h11 with the same cap (h11 answers a
plain-text 400).
"""

from __future__ import annotations

import importlib
import json
from typing import Any

MAX_HEAD_BYTES = 64 * 2**10  # request line + headers; nginx's default allows 32 KiB


def uvicorn_http_options(use_httptools: bool | None = None) -> dict[str, Any]:
    """`uvicorn.Config` keyword arguments choosing the HTTP implementation with the cap:
    httptools behind the head counter (by default where it imports), else h11 with its
    own limit."""
    if use_httptools is None:
        use_httptools = can_import("httptools")
    if use_httptools:  # by name: uvicorn imports it (it imports httptools)
        return {"http": "modelship.httptools_limited:HeadLimitedHttpToolsProtocol"}
    return {"http": "h11", "h11_max_incomplete_event_size": MAX_HEAD_BYTES}


def head_too_large_response(default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The whole 431 response (the connection is closed after it)."""
    body = json.dumps({"error": {
        "message": f"request line and headers larger than {MAX_HEAD_BYTES // 2**10} KiB",
        "type": "invalid_request_error", "param": None,
        "code": "request_header_fields_too_large",
    }}).encode()  # fmt: skip
    lines = [b"HTTP/1.1 431 Request Header Fields Too Large"]
    lines += [name + b": " + value for name, value in default_headers]
    lines += [b"content-type: application/json", b"content-length: " + str(len(body)).encode(),
              b"connection: close"]  # fmt: skip
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def can_import(name: str) -> bool:
    """Whether an optional speed-up (uvloop, httptools) is installed."""
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True
