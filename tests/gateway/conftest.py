"""Fixtures shared by the gateway tests that need a real Redis-protocol server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from redis_process import RedisProcess


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """One server per test module (tests that kill it start it again); close() also gives
    back the port it held."""
    process = RedisProcess(tmp_path_factory.mktemp("redis") / "redis.log")
    process.start()
    yield process
    process.close()
