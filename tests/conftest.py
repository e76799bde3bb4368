"""Shared fixtures: a tiny Qwen3 and the toy task's tokenizer, built offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# one JIT build of each DeepSpeed op for every test and every process they start (ranks, CLI runs, Ray workers),
# outside the repository
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions"))
from arctic_rl.rollout.engines.vllm.env import apply_vllm_env_defaults  # noqa: E402  (light: no torch, no vLLM)

apply_vllm_env_defaults()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from arctic_rl.tasks.toy import build_tokenizer, tiny_qwen3_config, write_task


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def toy_task(tmp_path_factory):
    """The toy task's directory: ``tokenizer/``, ``train.jsonl``, ``val.jsonl``."""
    return write_task(tmp_path_factory.mktemp("toy"), num_train=64, num_val=8)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A ``save_pretrained`` directory of a seeded random tiny Qwen3 plus the toy tokenizer."""
    from arctic_rl.modules.models import build_causal_lm

    torch.manual_seed(0)
    model = build_causal_lm(tiny_qwen3_config(len(tokenizer)), "float32")
    out = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def quickstart_cli_runs(request, tmp_path_factory, toy_task):
    """Real ``python -m arctic_rl.cli fit`` runs of the quickstart (6 steps, a checkpoint every 3), each in its
    own directory and fresh ``$TMPDIR``: ``[(root, config path, finished process)]``. The first is shared by the
    run-lifecycle and reproducibility tests; a second run of the same config, started at the same time, is
    made only when a collected test asks for ``quickstart_cli_rerun``."""
    from tests.helpers import cli_in_together, quickstart_cli_config, write_config

    names = ["quickstart_cli"]
    if any("quickstart_cli_rerun" in item.fixturenames for item in request.session.items):
        names.append("quickstart_cli_rerun")
    runs = []
    for name in names:
        root = tmp_path_factory.mktemp(name)
        (root / "tmp").mkdir()
        runs.append((root, write_config(quickstart_cli_config(toy_task, root), root / "c.yaml")))
    procs = cli_in_together([(["fit", "--config", str(path)], root, root / "tmp") for root, path in runs])
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return [(root, path, proc) for (root, path), proc in zip(runs, procs)]


@pytest.fixture(scope="session")
def quickstart_cli_run(quickstart_cli_runs):
    """The shared quickstart run of ``quickstart_cli_runs``: ``(root, config path, finished process)``."""
    return quickstart_cli_runs[0]


@pytest.fixture(scope="session")
def quickstart_cli_rerun(quickstart_cli_runs):
    """The second run of the same config, made beside ``quickstart_cli_run``: ``(root, config path, finished process)``."""
    return quickstart_cli_runs[1]


# Processes a test module leaves behind (engines, Ray daemons, servers, wandb services): the descendants of this
# process born during the module and still alive a few seconds after it. Reported in the terminal summary (and,
# with ARCTIC_RL_LEAK_REPORT=path, as lines in that file) so a leak names its module; a test that starts something
# must stop it.
_leaks: dict[str, list[str]] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_processes_left_behind(request):
    import psutil

    def alive():
        return {p.pid: p for p in psutil.Process().children(recursive=True)}

    before = set(alive())
    yield
    left = [p for pid, p in alive().items() if pid not in before]
    _, left = psutil.wait_procs(left, timeout=5)
    if left:
        names = []
        for p in left:
            try:
                names.append(f"{p.pid} {p.name()} {' '.join(p.cmdline())[:120]}")
            except psutil.Error:
                continue
        if names:
            _leaks[request.node.nodeid] = names


def pytest_terminal_summary(terminalreporter):
    if not _leaks:
        return
    terminalreporter.section("processes left behind by test modules")
    lines = [f"{module}: {name}" for module, names in _leaks.items() for name in names]
    for line in lines:
        terminalreporter.write_line(line)
    path = os.environ.get("ARCTIC_RL_LEAK_REPORT")
    if path:
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")
