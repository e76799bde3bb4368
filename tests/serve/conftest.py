"""Fixtures for the service's transport tests: real servers running the fake handler, each stopped (by its PID)."""

from __future__ import annotations

import pytest

from arctic_rl.serve.server import ServerProcess
from tests.serve.fake_handler import start_fake_server


@pytest.fixture
def fake_servers():
    """``fake_servers(config, **start_server_process_kwargs)`` starts one; all are stopped at teardown."""
    started: list[ServerProcess] = []

    def start(config: dict | None = None, **kwargs) -> ServerProcess:
        started.append(start_fake_server(config, **kwargs))
        return started[-1]

    yield start
    for server in started:
        server.stop()
