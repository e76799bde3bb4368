"""A FAKE handler for the transport tests: a stand-in for the service core (not under test here).

    echo   the request's tensors doubled (``t + t``: booleans come back unchanged), its meta echoed
    slow   sleeps ``meta["seconds"]``, then replies ``{"slept": seconds}``
    fail   raises ``RequestError``
    crash  raises ``RuntimeError``
    count  replies ``{"calls": n}``: how many ops (other than count) reached the handler
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from arctic_rl.serve.errors import RequestError, UnknownOperation
from arctic_rl.serve.server import ServerProcess, start_server_process
from arctic_rl.serve.transport import Message

REPO = Path(__file__).resolve().parents[2]
FACTORY = "tests.serve.fake_handler:build"


class EchoHandler:
    """The fake: see the module docstring for its ops."""

    def __init__(self, config: dict):
        self.config = config
        self.calls = 0
        self.closed = False
        self._lock = threading.Lock()

    def call(self, op: str, request: Message, timeout_s: float | None = None) -> Message:
        if op == "count":
            return Message({"calls": self.calls})
        with self._lock:
            self.calls += 1
        if op == "echo":
            return Message(dict(request.meta), {name: t + t for name, t in request.tensors.items()})
        if op == "slow":
            time.sleep(request.meta["seconds"])
            return Message({"slept": request.meta["seconds"]})
        if op == "fail":
            raise RequestError(f"fail was asked to fail (meta {request.meta})")
        if op == "crash":
            raise RuntimeError("crash was asked to crash")
        raise UnknownOperation(f"the fake has no op {op!r}; it has echo, slow, fail, crash, count")

    def close(self) -> None:
        """Marks itself closed (and writes ``config["closed_file"]`` if given, for a test to see)."""
        self.closed = True
        if "closed_file" in self.config:
            with open(self.config["closed_file"], "w") as f:
                f.write("closed")


def build(config: dict) -> EchoHandler:
    """The factory (``--handler tests.serve.fake_handler:build``); ``{"refuse": "why"}`` makes it raise."""
    if "refuse" in config:
        raise RuntimeError(f"EchoHandler refused to build: {config['refuse']}")
    return EchoHandler(config)


def start_fake_server(config: dict | None = None, **kwargs) -> ServerProcess:
    """``python -m arctic_rl.serve.server --handler tests.serve.fake_handler:build`` on 127.0.0.1, ready."""
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return start_server_process({} if config is None else config, handler=FACTORY,
                                env={"PYTHONPATH": pythonpath}, startup_timeout_s=60, **kwargs)
