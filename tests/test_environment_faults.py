"""Faults of the machine a run writes to, each one line naming the path with exit status 2: a read-only
run directory, a full ``$TMPDIR``, a full disk under the checkpoint, and a SIGTERM during start-up (which
must not leave the run's temporary directory behind).

The faults are real: a read-only or full filesystem is a small tmpfs mounted for the test (skipped where
this process may not mount; without root, a read-only directory is a ``chmod``), and the full disk under
a checkpoint write is ``/dev/full``, whose writes the kernel fails with ``ENOSPC`` (a checkpoint on a
full tmpfs, written by the trainer: ``tests/resume/test_atomic_checkpoints.py``).
"""

import contextlib
import os
import re
import signal
import subprocess
import time

import pytest
import torch

from arctic_rl.callbacks.atomic_checkpoints import write_atomically
from arctic_rl.errors import exit_on_config_error
from arctic_rl.temp_dirs import PREFIX
from tests.helpers import cli_in, quickstart_config, run_cli, write_config


@contextlib.contextmanager
def tmpfs(path, size: str, read_only: bool = False):
    """A tmpfs of ``size`` mounted at ``path`` (read-only if asked) for the block; skip where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def fill(directory) -> None:
    """Write into ``directory`` until its filesystem is full."""
    with contextlib.suppress(OSError), open(directory / "filler", "wb") as f:  # the close fails too
        while True:
            f.write(b"\0" * 4096)
            f.flush()


@contextlib.contextmanager
def read_only_dir(path):
    """A directory this process cannot write: ``chmod 555`` without root, else a read-only tmpfs."""
    if os.geteuid() != 0:
        path.mkdir()
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    with tmpfs(path, "1m", read_only=True):
        yield path


def test_a_read_only_run_dir_is_one_line_naming_it(tmp_path, toy_task):
    with read_only_dir(tmp_path / "ro") as ro:
        proc = run_cli(quickstart_config(toy_task, ro / "run"), tmp_path / "c.yaml")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert re.fullmatch(rf"error: trainer.default_root_dir {ro}/run: cannot write in {ro} \((a read-only file system|no write "
                        rf"permission)\); make it writable or point trainer.default_root_dir elsewhere", proc.stderr.splitlines()[-1])


def test_a_full_tmpdir_is_one_line_naming_it(tmp_path, toy_task):
    with tmpfs(tmp_path / "tmp", "1m") as tmpdir:
        fill(tmpdir)
        proc = run_cli(quickstart_config(toy_task, tmp_path / "run"), tmp_path / "c.yaml", TMPDIR=str(tmpdir))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        f"error: $TMPDIR {tmpdir} has 0 MiB free, less than the 256 MiB a run needs (the rollout engine's copy of the weights,"
        " torch.compile's builds); free space there or point TMPDIR at a directory on a filesystem with room")


def _save_to_a_full_disk(f) -> None:
    """torch.save of a checkpoint, its bytes going to ``/dev/full`` (the kernel fails each write with ENOSPC)."""
    with open("/dev/full", "wb") as full:
        torch.save({"w": torch.zeros(1 << 16)}, full)


def test_a_full_disk_under_a_checkpoint_names_it_and_keeps_the_previous_one(tmp_path, capsys):
    path = tmp_path / "last.ckpt"
    path.write_bytes(b"previous")
    with pytest.raises(SystemExit) as exit_info, exit_on_config_error():
        write_atomically(path, _save_to_a_full_disk)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: cannot write {path}: the disk is full (ENOSPC); free space in {tmp_path} (the previous checkpoint there is intact)"]
    assert path.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temp file left


def test_a_sigterm_during_start_up_leaves_no_temporary_directory(tmp_path, toy_task):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    path = write_config(quickstart_config(toy_task, tmp_path / "run"), tmp_path / "c.yaml")
    run = cli_in(["fit", "--config", str(path)], tmp_path, tmpdir, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmpdir.glob(PREFIX + "*")) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(tmpdir.glob(PREFIX + "*")), "the run made no temporary directory"
        time.sleep(2)  # into the start-up: parsing, building the trainer
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert list(tmpdir.glob(PREFIX + "*")) == []
