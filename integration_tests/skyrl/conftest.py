"""Fixtures of the SkyRL integration tests: the quickstart's tiny Qwen3, and SkyRL's own Tinker API server
(which starts SkyRL's engine with backend ``arctic``) running on loopback, stopped by PID at the end.

Run with the SkyRL layer first on the path (``scripts/integrations/skyrl.sh`` does):
``PYTHONPATH=.venv/site-skyrl:$PWD .venv/bin/python -m pytest integration_tests/skyrl``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The quickstart's ~0.3M Qwen3 (toy tokenizer), randomly initialised with seed 0, ``save_pretrained``."""
    from arctic_rl.tasks.toy import write_task, write_tiny_model

    task = write_task(tmp_path_factory.mktemp("toy"), num_train=8, num_val=2)
    out = write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)
    (out / "prompts.jsonl").write_text((task / "train.jsonl").read_text())
    return out


@dataclass
class SkyRLServer:
    url: str
    checkpoints: Path  # SkyRL's --checkpoints-base
    log: Path
    process: subprocess.Popen
    plugin_marker: Path  # the test plugin loss appends a line per micro-batch it computes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: SkyRLServer, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"SkyRL API server exited ({server.process.returncode}):\n{server.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(server.url + "/api/v1/healthz", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"SkyRL API server not healthy after {timeout_s}s:\n{server.log.read_text()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    """Stop the API server (its shutdown stops the engine), then any of its descendants still alive, by PID."""
    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for child in descendants:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def skyrl_server(tiny_model_dir, tmp_path_factory):
    """``python -m arctic_rl.integrations.skyrl serve`` on a free loopback port with the quickstart's
    hyperparameters; ``sampling.max_response_length`` covers a whole sequence (``forward`` answers every token).
    The test plugin package (``tests/plugin_package.py``) is installed for it, and ``loss_fns`` routes Tinker's
    ``cispo`` to its ``scaled_pg`` at scale 2 (no other test here uses ``cispo``)."""
    from tests.plugin_package import PACKAGE, PLUGIN, write_plugin

    root = tmp_path_factory.mktemp("skyrl")
    write_plugin(root / "site", PACKAGE, f"[arctic_rl.losses]\nscaled_pg = {PACKAGE}.losses\n", {"losses": PLUGIN})
    backend_config = {
        "training": {"accelerator": "cpu"}, "optim": {"learning_rate": 0.003, "max_grad_norm": 1.0},
        "engines": {"engine": "vllm"}, "sampling": {"max_prompt_length": 32, "max_response_length": 48, "temperature": 1.0},
        "server": {"root_dir": str(root / "arctic")},
        "loss_fns": {"cispo": {"loss": "scaled_pg", "config": {"scale": 2.0}}},
    }
    env = {**os.environ, "ARL_PLUGIN_MARKER": str(root / "plugin-marker"),
           "PYTHONPATH": os.pathsep.join([str(root / "site"), os.environ.get("PYTHONPATH", "")])}
    port = _free_port()
    log = root / "server.log"
    cmd = [sys.executable, "-m", "arctic_rl.integrations.skyrl", "serve", "--base-model", str(tiny_model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--database-url", f"sqlite:///{root / 'tinker.db'}",
           "--checkpoints-base", str(root / "checkpoints"), "--backend-config", json.dumps(backend_config)]
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=root, env=env)
    server = SkyRLServer(f"http://127.0.0.1:{port}", root / "checkpoints", log, process, root / "plugin-marker")
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(process)
