"""SIGTERM while an operation runs: the caller is told at once, and the server stops waiting for the
operation after a bounded time, says so in one line, and exits (a real server process, a real core)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.core import OPERATION_GRACE_S
from arctic_rl.serve.errors import JobFailed
from arctic_rl.serve.server import start_server_process
from tests.serve.conftest import client_config
from tests.serve.fake_handler import REPO
from tests.serve.test_core_requests import sampled_batch

FACTORY = "tests.serve.slow_loss:build"  # a string, not an import: the "slow" loss is registered in the server only

pytestmark = pytest.mark.slow
UVICORN_GRACE_S = 5.0  # serve()'s shutdown_grace_s: in-flight requests are answered within it


def test_sigterm_during_a_long_operation_is_bounded_and_said(tiny_model_dir, tmp_path):
    config = client_config(tiny_model_dir, tmp_path / "root", engines={"engine": "transformers"})
    log, started = tmp_path / "server.log", tmp_path / "started"
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    server = start_server_process(config, handler=FACTORY, env={"PYTHONPATH": pythonpath}, startup_timeout_s=600, log_file=log)
    errors: list[BaseException] = []
    try:
        client = ArcticRLClient(protocol="http", server_url=server.url, auth_token=server.token, timeouts={"call_s": 300.0})
        batch = sampled_batch(client)

        def long_call() -> None:
            try:
                client.forward_backward(batch, "slow", {"seconds": 300, "started_file": str(started)})
            except BaseException as e:  # noqa: BLE001  (checked below)
                errors.append(e)

        caller = threading.Thread(target=long_call)
        caller.start()
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists()
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=UVICORN_GRACE_S + OPERATION_GRACE_S + 20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still ran {time.monotonic() - signalled:.0f} s after SIGTERM")
        caller.join(timeout=30)
        assert len(errors) == 1 and isinstance(errors[0], JobFailed), errors
        assert "'forward_backward'" in str(errors[0])
        said = [line for line in log.read_text().splitlines() if line.startswith("arctic-rl serve: ")]
        assert said[-1] == (f"arctic-rl serve: 'forward_backward' was still running {OPERATION_GRACE_S:g} s after the "
                            "job was asked to close; stopped waiting for it (its result is lost)")
        client.close()
    finally:
        server.stop()
