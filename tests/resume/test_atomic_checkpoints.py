"""Checkpoints are published atomically on the checkpoint's own filesystem: a write that fails (disk
full, a kill) never replaces or truncates the previous good checkpoint, and leaves no temp file."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pytest
import torch

from arctic_rl.cli import build_cli
from arctic_rl.errors import UnwritablePath, os_error_in
from tests.helpers import quickstart_config, write_config

pytestmark = pytest.mark.slow


@pytest.fixture
def checkpoint_fs(tmp_path, monkeypatch):
    """``(directory, real)``: a small tmpfs (another filesystem than ``TMPDIR``) when this runs as root and
    may mount; otherwise a plain directory, with every cross-directory rename patched to fail with EXDEV
    as it does between filesystems (a fake of the OS, named as such)."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    if os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(directory)]).returncode == 0:
        yield directory, True
        subprocess.run(["umount", str(directory)], check=True)
        return
    real_replace, real_rename = os.replace, os.rename

    def fake_cross_device(real):
        def move(src, dst, *args, **kwargs):
            if os.path.dirname(os.path.abspath(src)) != os.path.dirname(os.path.abspath(dst)):
                raise OSError(errno.EXDEV, "Invalid cross-device link (fake)", str(src))
            return real(src, dst, *args, **kwargs)
        return move

    monkeypatch.setattr(os, "replace", fake_cross_device(real_replace))
    monkeypatch.setattr(os, "rename", fake_cross_device(real_rename))
    yield directory, False


def test_a_full_disk_during_a_save_leaves_the_previous_checkpoint_intact(toy_task, tmp_path, checkpoint_fs):
    directory, real_fs = checkpoint_fs
    config = quickstart_config(toy_task, tmp_path, **{"model.init_args.sampling.group_size": 2, "trainer.max_steps": 1,
                                                      "trainer.enable_progress_bar": False})
    config["trainer"]["callbacks"][1]["init_args"]["dirpath"] = str(directory)
    cli = build_cli(["--config", str(write_config(config, tmp_path / "c.yaml"))], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)  # writes last.ckpt (step 1) across a filesystem boundary
    last = directory / "last.ckpt"
    good = last.read_bytes()
    assert torch.load(last, weights_only=False)["global_step"] == 1
    if not real_fs:  # no small filesystem to fill: the save across the (fake) boundary must still succeed
        cli.trainer.save_checkpoint(last)
        assert sorted(os.listdir(directory)) == ["last.ckpt"]
        return
    free = shutil.disk_usage(directory).free
    (directory / "filler").write_bytes(b"\0" * (free - len(good) // 2))  # room for half a checkpoint
    for target in ("step=2.ckpt", "last.ckpt"):  # a new checkpoint, and a replacement of the good one
        with pytest.raises(UnwritablePath) as failed:  # one line from arctic-rl, naming the file (torch.save names none)
            cli.trainer.save_checkpoint(directory / target)
        assert str(failed.value) == (f"cannot write {directory / target}: the disk is full (ENOSPC); free space in {directory}"
                                     " (the previous checkpoint there is intact)")
        assert os_error_in(failed.value).errno == errno.ENOSPC, target
        assert sorted(os.listdir(directory)) == ["filler", "last.ckpt"], target  # no truncated file, no temp file
        assert last.read_bytes() == good, target
    (directory / "filler").unlink()
    cli.trainer.save_checkpoint(last)
    assert torch.load(last, weights_only=False)["global_step"] == 1 and sorted(os.listdir(directory)) == ["last.ckpt"]
