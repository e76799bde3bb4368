"""The server process: refusing an open host without a token, config loading, readiness, and SIGTERM closing it."""

from __future__ import annotations

import re

import pytest

from arctic_rl.serve.errors import JobFailed
from arctic_rl.errors import ConfigError
from arctic_rl.serve.server import StartRefused, load_config, main, serve
from tests.serve.fake_handler import FACTORY


def test_an_open_host_without_a_token_is_refused_before_the_handler_is_built(monkeypatch, capsys):
    monkeypatch.delenv("ARCTIC_RL_TOKEN", raising=False)
    # the factory would raise if it were called: the refusal must come first
    assert main(["--handler", FACTORY, "--host", "0.0.0.0", "--set", "refuse=built anyway"]) == 2
    assert "refusing to listen on 0.0.0.0 without an auth token" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="without an auth token"):
        serve(FACTORY, {"refuse": "built anyway"}, host="10.1.2.3")


def test_the_config_is_the_yaml_mapping_with_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model:\n  name: tiny\n  lr: 1.0e-6\nseed: 1\n")
    config = load_config(str(path), ["model.lr=3.0e-6", "trainer.max_steps=10", "seed=null"])
    assert config == {"model": {"name": "tiny", "lr": 3e-6}, "trainer": {"max_steps": 10}, "seed": None}
    assert load_config(None, []) == {}
    with pytest.raises(StartRefused, match="expects dotted.key=value"):
        load_config(None, ["seed"])
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(StartRefused, match="expected a mapping"):
        load_config(str(tmp_path / "list.yaml"), [])


def test_a_server_that_dies_starting_fails_fast_with_its_output(fake_servers):
    with pytest.raises(JobFailed, match="exited with code 1 before it was ready(.|\n)*refused to build: testing"):
        fake_servers({"refuse": "testing"})


def test_sigterm_closes_the_handler_then_exits(fake_servers, tmp_path):
    closed, log = tmp_path / "closed", tmp_path / "server.log"
    server = fake_servers({"closed_file": str(closed)}, log_file=log)
    assert re.search(r"arctic-rl serve: listening on (\S+)", log.read_text()).group(1) == server.url
    assert server.stop() == 0 and server.stop() == 0  # idempotent
    assert closed.read_text() == "closed"


def test_arctic_rl_serve_refuses_a_bad_config_in_one_line(tmp_path):
    """``arctic-rl serve`` (the real CLI) with an unknown config field: exit status 2, one line naming it."""
    import subprocess
    import sys

    from tests.helpers import REPO, cli_env

    config = tmp_path / "client.yaml"
    config.write_text("model: some/model\noptim: {learning_rte: 0.1}\n")
    done = subprocess.run([sys.executable, "-m", "arctic_rl.cli", "serve", "--config", str(config)], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "optim.learning_rte: unknown field" in done.stderr and "Traceback" not in done.stderr


def test_relative_paths_in_a_serve_config_are_relative_to_the_file(tmp_path, monkeypatch):
    """The rule of ``fit`` (config_paths.py): in the file, ``tokenizer``, ``root_dir`` and ``./``-paths resolve
    against its directory; a hub id stays as it is; ``--set`` values stay relative to the working directory."""
    (tmp_path / "jobs").mkdir()
    path = tmp_path / "jobs" / "client.yaml"
    path.write_text("model: ./models/tiny\ntokenizer: tok\nserver: {root_dir: states}\nengines: {engine: vllm}\n")
    monkeypatch.chdir(tmp_path)
    config = load_config(str(path), ["optim.learning_rate=0.1", "tokenizer=here/tok"])
    assert config["model"] == str(tmp_path / "jobs" / "models" / "tiny")
    assert config["server"]["root_dir"] == str(tmp_path / "jobs" / "states")
    assert config["tokenizer"] == "here/tok" and config["engines"] == {"engine": "vllm"}
    path.write_text("model: Qwen/Qwen3-1.7B\n")
    assert load_config(str(path), []) == {"model": "Qwen/Qwen3-1.7B"}


def test_arctic_rl_serve_on_a_busy_port_is_one_line_naming_it(tmp_path):
    """``arctic-rl serve --port P`` while something listens on P: exit status 2 and one line naming the port."""
    import socket
    import subprocess
    import sys

    from tests.helpers import REPO, cli_env

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "arctic_rl.cli", "serve", "--port", str(port)], cwd=REPO,
                              env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("arctic-rl serve:")]
    assert lines == [f"arctic-rl serve: port {port} on 127.0.0.1 is already in use: stop what listens there, "
                     "or pick another --port (0: a free port)"], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("server_section, limit_mb", [(None, 512), ({"max_request_mb": 2}, 2)])
def test_the_body_limit_is_the_configs_else_512_mib(fake_servers, server_section, limit_mb):
    """The README's default (512 MiB) holds whether or not the YAML names ``server.max_request_mb``."""
    import httpx

    server = fake_servers({} if server_section is None else {"server": server_section})
    assert httpx.get(f"{server.url}/v1/health", timeout=30).json()["max_request_bytes"] == limit_mb * 2**20
