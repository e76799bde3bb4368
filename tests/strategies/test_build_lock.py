"""A stale DeepSpeed JIT-build lock stops ArcticStrategy with the file to delete, instead of a silent hang."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from lightning.pytorch.accelerators import CPUAccelerator
from torch.utils.cpp_extension import _get_build_directory

from arctic_rl.strategies import ArcticStrategy
from arctic_rl.strategies.build_lock import StaleBuildLockError, check_build_locks, extensions_root


def make_lock(root: Path, op: str, age_s: float) -> Path:
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


@pytest.mark.parametrize("configured", [True, False])
def test_extensions_root_is_where_torch_builds(tmp_path, monkeypatch, configured):
    if configured:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    else:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # torch's default root follows it
    assert Path(_get_build_directory("some_op", verbose=False)) == extensions_root() / "some_op"


def test_stale_lock_is_refused_naming_the_file_young_lock_warns(tmp_path):
    stale = make_lock(tmp_path, "deepspeed_shm_comm", age_s=3600)
    with pytest.raises(StaleBuildLockError, match=re.escape(f"60 min old: {stale}") + ".*" + re.escape(f"rm {stale}")):
        check_build_locks(("fused_adam", "deepspeed_shm_comm"), root=tmp_path)
    young = make_lock(tmp_path, "fused_adam", age_s=5)
    with pytest.warns(UserWarning, match=re.escape(f"{young} exists") + ".*another process is building"):
        check_build_locks(("fused_adam",), root=tmp_path)
    check_build_locks(("cpu_adam",), root=tmp_path)  # no lock: nothing to say
    assert stale.exists() and young.exists()  # never deleted for the user


def test_arctic_strategy_refuses_before_deepspeed_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    make_lock(tmp_path, "cpu_adam", age_s=2 * 3600)  # an op DeepSpeed builds on CPU (its shm op is not built at all)
    strategy = ArcticStrategy(stage=2)
    strategy.accelerator = CPUAccelerator()
    with pytest.raises(StaleBuildLockError, match="cpu_adam"):
        strategy.setup_environment()
