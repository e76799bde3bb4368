"""``start_server_process``: launch ``python -m arctic_rl.serve.server`` in its own process group and wait until it is
ready (``ServerProcess``: its URL, token and PID; ``stop()`` ends it). Apart from ``server.py`` so that what starts
servers (the client's ``protocol: http``, the multi-rank front in ``ranks/ranked.py``) does not import the server's app,
whose handlers import those starters in turn."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from arctic_rl.serve.errors import JobFailed, ServiceTimeout
from arctic_rl.serve.factory import DEFAULT_FACTORY


class ServerProcess:
    """A server ``start_server_process`` launched: ``url``, ``token``, ``pid``; ``stop()`` ends it."""

    def __init__(self, process: subprocess.Popen, token: str, workdir: Path, log_path: Path):
        self.process = process
        self.token = token
        self.log_path = log_path  # the server's stdout and stderr
        self.url: str | None = None  # known once ready
        self._workdir = workdir
        self._stopped = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def request_stop(self) -> None:
        """SIGTERM without waiting (several servers that stop together, e.g. a job's training ranks, which end
        with a barrier of all of them): ``stop()`` then waits. Idempotent."""
        if not self._stopped and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL its process group; idempotent. Returns the exit code."""
        if not self._stopped:
            self._stopped = True
            atexit.unregister(self.stop)
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)  # again after request_stop: harmless, the server is stopping
                try:
                    self.process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(self.process.pid, signal.SIGKILL)  # its own group: the server and what it started
                    self.process.wait()
            shutil.rmtree(self._workdir, ignore_errors=True)
        return self.process.returncode

    def output_tail(self, max_chars: int = 4000) -> str:
        """The end of the server's output (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except FileNotFoundError:
            return ""

    def _wait_until_ready(self, ready_file: Path, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready_file.exists():
            if self.process.poll() is not None:
                raise JobFailed(f"the server (pid {self.pid}) exited with code {self.process.returncode} before it "
                                f"was ready; its output ends with:\n{self.output_tail()}")
            if time.monotonic() > deadline:
                raise ServiceTimeout(f"the server (pid {self.pid}) was not ready after {timeout_s:g} s; its output "
                                     f"ends with:\n{self.output_tail()}")
            time.sleep(0.05)
        self.url = json.loads(ready_file.read_text())["url"]


def start_server_process(config: str | os.PathLike | dict[str, Any], *, handler: str = DEFAULT_FACTORY,
                         host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                         startup_timeout_s: float = 300.0, max_request_bytes: int | None = None,
                         call_timeout_s: float | None = None, env: dict[str, str] | None = None,
                         log_file: str | os.PathLike | None = None, api: str = "arctic") -> ServerProcess:
    """Launch ``python -m arctic_rl.serve.server`` in its own process group and wait until it is ready.

    Args:
        config: a YAML file's path, or the config dict itself (written to a temporary YAML file).
        handler: the handler factory's ``"package.module:function"`` path.
        token: the bearer token; None makes a fresh random one (``ServerProcess.token``; ``tml-...`` for ``api``
            tinker, the SDK's prefix), passed to the server in ``$ARCTIC_RL_TOKEN`` (not on its command line).
        env: variables added to this process's environment for the server (e.g. ``PYTHONPATH``).
        max_request_bytes: the body size limit; None: the config's ``server.max_request_mb`` (else 512 MiB).
        log_file: where the server's output goes (default: a temporary file, removed by ``stop``).
        api: the routes, ``arctic``, ``tinker`` or ``openai`` (``--api``).

    Raises ``JobFailed`` (with the server's output) if it exits first, ``ServiceTimeout`` after
    ``startup_timeout_s``; either way the process is stopped. ``stop()`` also runs at interpreter exit.
    """
    workdir = Path(tempfile.mkdtemp(prefix="arctic-rl-serve-"))
    if isinstance(config, dict):
        import yaml

        config_path = workdir / "config.yaml"
        config_path.write_text(yaml.safe_dump(config))
    else:
        config_path = Path(config)
    token = token or ("tml-" if api == "tinker" else "") + secrets.token_urlsafe(32)  # the tinker SDK's key prefix
    ready_file = workdir / "ready.json"
    command = [sys.executable, "-m", "arctic_rl.serve.server", "--handler", handler, "--config", str(config_path),
               "--host", host, "--port", str(port), "--ready-file", str(ready_file), "--api", api]
    if max_request_bytes is not None:
        command += ["--max-request-bytes", str(max_request_bytes)]
    if call_timeout_s is not None:
        command += ["--call-timeout-s", str(call_timeout_s)]
    log_path = Path(log_file) if log_file is not None else workdir / "server.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, env={**os.environ, **(env or {}), "ARCTIC_RL_TOKEN": token},
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    server = ServerProcess(process, token, workdir, log_path)
    atexit.register(server.stop)
    try:
        server._wait_until_ready(ready_file, startup_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server
