"""A run's lifecycle through real ``python -m arctic_rl.cli fit`` processes: what the console shows and
what goes to the log file, temporary files after a normal exit and after ``kill -9``, and a rerun
into a checkpoint directory that already holds a run."""

import os
import signal
import time
from pathlib import Path

import pytest

from arctic_rl.temp_dirs import PREFIX, host_tag
from tests.helpers import cli_in, quickstart_config, write_config

pytestmark = pytest.mark.slow  # real training runs and a real vLLM engine

NOISE = (  # on every run before; each is KNOWN_NOISE in arctic_rl/console.py
    "is not found in LD_PRELOAD",  # vLLM (libtcmalloc, libiomp)
    "Using ModelCheckpoint with manual optimization",  # Lightning, with a code sample
    "LightningCLI's args parameter is intended",
    "Tip: For seamless cloud logging",  # litlogger
)


def _leftovers(tmpdir: Path) -> list[str]:
    """Everything under ``tmpdir`` except torch.compile's cache, which is meant to outlive runs."""
    return sorted(str(p.relative_to(tmpdir)) for p in tmpdir.rglob("*") if not p.relative_to(tmpdir).parts[0].startswith("torchinductor_"))


def test_console_shows_no_library_noise_and_the_log_file_has_it(quickstart_cli_run):
    root, _, proc = quickstart_cli_run
    console = proc.stdout + proc.stderr
    assert "arctic-rl: 6 steps" in console  # the run's own summary
    assert [n for n in NOISE if n in console] == []
    log = (root / "logs/version_0/arctic-rl.log").read_text()
    assert [n for n in NOISE if n not in log] == ["LightningCLI's args parameter is intended"]  # no longer raised at all
    assert log.count("is not found in LD_PRELOAD") >= 1


def test_normal_exit_leaves_no_temporary_files(quickstart_cli_run):
    root, _, _ = quickstart_cli_run
    assert _leftovers(root / "tmp") == []


def test_rerun_into_a_used_checkpoint_directory_is_refused_and_resume_continues(quickstart_cli_run):
    root, path, _ = quickstart_cli_run
    checkpoints = root / "checkpoints"
    before = sorted(p.name for p in checkpoints.iterdir())
    assert before == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    rerun = cli_in(["fit", "--config", str(path)], root, root / "tmp")
    assert rerun.returncode == 2
    assert rerun.stderr.splitlines()[-1] == (
        f"error: {checkpoints} already holds checkpoints of an earlier run (epoch=0-step=3.ckpt, epoch=1-step=6.ckpt,"
        f" last.ckpt); this run would mix its checkpoints with them. Resume that run with --ckpt_path"
        f" {checkpoints / 'last.ckpt'}, or start a new one in another directory (the ModelCheckpoint dirpath) or"
        f" after deleting {checkpoints}"
    )
    # the documented resume command is accepted (here it has nothing left to do: max_steps is reached)
    resume = cli_in(["fit", "--config", str(path), "--ckpt_path", str(checkpoints / "last.ckpt")], root, root / "tmp")
    assert resume.returncode == 0, resume.stderr[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == before  # no last-v1.ckpt


def test_a_killed_runs_temporary_files_are_removed_by_the_next_start(tmp_path, toy_task):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    logger = {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"save_dir": str(tmp_path), "project": "t"}}
    path = write_config(quickstart_config(toy_task, tmp_path, **{"trainer.logger": logger}), tmp_path / "c.yaml")
    run = cli_in(["fit", "--config", str(path)], tmp_path, tmpdir, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list(tmpdir.rglob("arctic-rl-engine-*/model.safetensors")) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # the run and its W&B service, as the OOM killer or kill -9 would
        run.wait()
    left = _leftovers(tmpdir)
    assert any(p.endswith("model.safetensors") for p in left) and any(p.endswith("wandb-media") for p in left), left
    live = tmpdir / f"{PREFIX}{host_tag()}-{os.getpid()}-live"  # a live process's directory
    other_host = tmpdir / f"{PREFIX}otherhost-{run.pid}-dead"  # another machine sharing $TMPDIR
    live.mkdir(), other_host.mkdir()

    start = cli_in(["fit", "--config", str(path), "--print_config"], tmp_path, tmpdir)
    assert start.returncode == 0, start.stderr[-3000:]
    assert f"arctic-rl: removed 1 temporary directories left by killed runs in {tmpdir}" in start.stderr
    assert _leftovers(tmpdir) == sorted([live.name, other_host.name])
