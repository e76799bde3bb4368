"""Building run configs for tests from configs/quickstart.yaml."""

from __future__ import annotations

import contextlib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def quickstart_config(toy_task: Path, root: Path, source: str = "configs/quickstart.yaml", engine: str | None = ...,
                      **changes) -> dict:
    """The quickstart config (or another of its shape, ``source``) pointed at ``toy_task`` data, writing
    under ``root``. ``changes`` maps dotted keys (``model.init_args.sampling.group_size``) to values; ``None``
    deletes the key. ``engine``: the rollout callback's engine; by default vLLM for the quickstart (the tests built
    on it exercise the vLLM engine, while the shipped quickstart runs the transformers engine) and the config's own
    for another ``source``; None keeps the config's."""
    config = yaml.safe_load((REPO / source).read_text())
    if engine is ...:
        engine = "vllm" if source == "configs/quickstart.yaml" else None
    for cb in config["trainer"].get("callbacks", []):
        if engine is not None and cb["class_path"].endswith("RolloutCallback"):
            cb["init_args"]["engine"] = engine
    config["model"]["init_args"]["tokenizer"] = str(toy_task / "tokenizer")
    config["data"]["init_args"]["train_path"] = str(toy_task / "train.jsonl")
    trainer = config["trainer"]
    trainer["default_root_dir"] = str(root)
    trainer["logger"]["init_args"]["save_dir"] = str(root)
    for cb in trainer["callbacks"]:
        if cb["class_path"].endswith("ModelCheckpoint"):
            cb["init_args"]["dirpath"] = str(root / "checkpoints")
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})  # a section the config does not set yet (model.init_args.compute)
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return config


def write_config(config: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def cli_env() -> dict:
    """The environment of an ``arctic_rl.cli`` subprocess: this checkout first on the path, offline."""
    import os

    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1",
            "WANDB_MODE": "offline", "RAY_USAGE_STATS_ENABLED": "0"}


def run_cli(config: dict, path: Path, *args: str, timeout: float = 300, **env: str):
    """``python -m arctic_rl.cli fit --config <config written to path> *args`` in a subprocess with
    ``env`` added to its environment."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "arctic_rl.cli", "fit", "--config", str(write_config(config, path)), *args]
    return subprocess.run(cmd, env={**cli_env(), **env}, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def quickstart_cli_config(toy_task, root: Path, steps: int = 6, checkpoint_every: int = 3) -> dict:
    """The quickstart for ``steps`` steps under ``root``, with a checkpoint every ``checkpoint_every`` steps."""
    config = quickstart_config(toy_task, root, **{"trainer.max_steps": steps, "trainer.enable_progress_bar": False})
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"]["every_n_train_steps"] = checkpoint_every
    return config


def cli_in(args: list[str], cwd: Path, tmpdir: Path, **popen):
    """``python -m arctic_rl.cli *args`` from ``cwd`` with ``$TMPDIR`` at ``tmpdir``: run to the end (captured
    output), or started and returned as a ``Popen`` when ``popen`` options are given."""
    import subprocess

    command, env = _cli_in_command(args, tmpdir)
    if popen:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _cli_in_command(args: list[str], tmpdir: Path) -> tuple[list[str], dict]:
    import sys

    env = {**cli_env(), "TMPDIR": str(tmpdir)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    return [sys.executable, "-m", "arctic_rl.cli", *args], env


def cli_in_together(runs: list[tuple[list[str], Path, Path]], timeout: float = 900) -> list:
    """Each ``(args, cwd, tmpdir)`` run as ``cli_in`` runs it, all started at once (their imports and engine
    start-ups, mostly one core each, overlap); their ``CompletedProcess``es, output kept in ``cwd/cli.out|err``."""
    import subprocess

    started = []
    for args, cwd, tmpdir in runs:
        command, env = _cli_in_command(args, tmpdir)
        with open(cwd / "cli.out", "w") as out, open(cwd / "cli.err", "w") as err:
            started.append((command, cwd, subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err)))
    done = []
    for command, cwd, proc in started:
        code = proc.wait(timeout=timeout)
        done.append(subprocess.CompletedProcess(command, code, (cwd / "cli.out").read_text(), (cwd / "cli.err").read_text()))
    return done


def run_cli_many(commands: dict[str, list[str]], workdir: Path, timeout: float = 600, parallel: int = 2,
                 limit_s: float = 180) -> dict:
    """``{name: CompletedProcess}`` of ``arctic-rl *argv`` for each ``commands`` entry, each in its own
    process forked from one that imported the CLI's dependencies once (``tests/cli_forks.py``), run from ``workdir``,
    ``parallel`` at a time; one still running after ``limit_s`` is killed (-9)."""
    import json
    import subprocess
    import sys

    names = list(commands)
    manifest = [{"argv": commands[n], "cwd": str(workdir), "stdout": str(workdir / f"{n}.out"),
                 "stderr": str(workdir / f"{n}.err")} for n in names]
    (workdir / "manifest.json").write_text(json.dumps(manifest))
    proc = subprocess.run([sys.executable, "-m", "tests.cli_forks", str(workdir / "manifest.json"), str(parallel), str(limit_s)], env=cli_env(),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    return {n: subprocess.CompletedProcess(commands[n], codes[str(i)], (workdir / f"{n}.out").read_text(),
                                           (workdir / f"{n}.err").read_text()) for i, n in enumerate(names)}


@contextlib.contextmanager
def app_on_loopback(app):
    """``app`` served by uvicorn on a free loopback port, in a thread of this process; yields its URL
    (``http://127.0.0.1:PORT``) and stops the server on exit."""
    import asyncio
    import socket
    import threading

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
