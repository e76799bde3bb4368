"""Shared by the service tests: a tiny pretrained model directory (the quickstart's model, seed 0), and
real servers running the fake handler for the transport tests, each stopped (by its PID)."""

from __future__ import annotations

from pathlib import Path

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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The quickstart's ~0.3M Qwen3, randomly initialised with seed 0, as a ``save_pretrained`` directory."""
    from arctic_rl.tasks.toy import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)


def client_config(model_dir: Path, root: Path, **changes) -> dict:
    """An ``ArcticRLClientConfig`` dict with the quickstart's hyperparameters (configs/quickstart.yaml)."""
    config = {
        "model": str(model_dir),
        "training": {"accelerator": "cpu"}, "optim": {"learning_rate": 0.003, "warmup_steps": 5, "max_grad_norm": 1.0},
        "engines": {"engine": "vllm"}, "sampling": {"max_prompt_length": 32, "max_response_length": 8, "temperature": 1.0},
        "server": {"root_dir": str(root)},
    }
    for section, values in changes.items():
        if isinstance(values, dict):
            config.setdefault(section, {}).update(values)
        else:
            config[section] = values
    return config
