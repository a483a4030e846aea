"""The gateway's uvicorn settings: uvloop and httptools where installed, else asyncio and h11."""

from __future__ import annotations

import sys

import pytest
from starlette.applications import Starlette

from modelship.gateway.launcher import server_config
from modelship.http_limits import MAX_HEAD_BYTES


def test_runs_on_uvloop_and_httptools_when_installed():
    pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    config = server_config(Starlette(), "127.0.0.1", 0)
    assert config.loop == "uvloop"
    config.load()
    assert issubclass(config.http_protocol_class, HttpToolsProtocol)  # with the head cap
    assert config.http_protocol_class is not HttpToolsProtocol


@pytest.mark.parametrize("missing", ["uvloop", "httptools"])
def test_falls_back_to_asyncio_and_h11_without_them(monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # importing it now raises ImportError
    config = server_config(Starlette(), "127.0.0.1", 0)
    assert (config.loop, config.http) == ("asyncio", "h11")
    assert config.h11_max_incomplete_event_size == MAX_HEAD_BYTES
    config.load()  # uvicorn accepts the fallback without importing the missing module
