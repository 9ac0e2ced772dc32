"""A real ``redis-server`` (Debian's) for the tests of separate rollout workers.

Tests that use :func:`redis_url` are marked ``redis``; they are skipped, saying why, only
where the ``redis-server`` binary is missing (CI installs it in its own step).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

NO_REDIS = shutil.which("redis-server") is None
needs_redis = pytest.mark.skipif(
    NO_REDIS, reason="redis-server is not on PATH (apt-get install redis-server)")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[object]:
    """A fresh ``redis-server`` on a free port of 127.0.0.1 (stopped afterwards)."""
    pytest.importorskip("redis", reason="redis-py is not installed: pip install "
                                        "'reasonctl[async]'")
    from reasonctl.async_rl.processes import LocalRedis

    server = LocalRedis.start(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: object) -> str:
    """The URL of :func:`redis_server`."""
    return str(redis_server.url)  # type: ignore[attr-defined]


def byte_parity(completion: str, sample: object) -> float:
    """A reward with spread for a random tiny model: 1 for an even number of UTF-8 bytes.

    Named in configs as ``redis_support:byte_parity`` (``tests/`` is on the path of the
    test process and of the trainers the tests start).
    """
    return float(len(completion.encode()) % 2 == 0)
