"""Refuse to start on a stale JIT-build lock: a DeepSpeed op build that was killed mid-way leaves torch's
``<extensions dir>/<op>/lock`` behind, and every later build of that op waits on it forever, silently.

DeepSpeed builds optimizer ops such as ``cpu_adam`` and, on CUDA, ``fused_adam`` on first use (its CPU shm
collectives are not built: ``patches.deepspeed.skip_shm_comm_op``). A build takes seconds to a couple of minutes; a lock older
than ``max_age_s`` is left over from a killed process, so the run stops with the file to delete instead of
hanging. A younger lock (another run building right now) is only reported.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

STALE_AFTER_S = 15 * 60


class StaleBuildLockError(RuntimeError):
    """A JIT-build lock file left by a killed build; the message names the file to delete."""


def extensions_root() -> Path:
    """torch's JIT-extension root, as ``torch.utils.cpp_extension`` computes it (``TORCH_EXTENSIONS_DIR``,
    else ``~/.cache/torch_extensions/py<XY>_<cpu|cuXY|rocmXY>``)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    if torch.version.hip is not None:
        flavour = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        flavour = "cu" + torch.version.cuda.replace(".", "")
    else:
        flavour = "cpu"
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}_{flavour}"


def check_build_locks(ops: tuple[str, ...], max_age_s: float = STALE_AFTER_S, root: Path | None = None) -> None:
    """Raise ``StaleBuildLockError`` for the first op in ``ops`` whose build lock is older than ``max_age_s``;
    warn for a younger one."""
    root = extensions_root() if root is None else root
    for op in ops:
        lock = root / op / "lock"
        try:
            age_s = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            continue
        if age_s > max_age_s:
            raise StaleBuildLockError(
                f"DeepSpeed's {op!r} op has a build lock {age_s / 60:.0f} min old: {lock}. A build of it was killed "
                f"mid-way, and every later build would wait on this file forever. If no other run is building "
                f"DeepSpeed ops right now, delete it (rm {lock}) and start again.")
        rank_zero_warn(f"{lock} exists ({age_s:.0f} s old): another process is building DeepSpeed's {op!r} op; "
                       f"this run waits for it (a lock older than {max_age_s / 60:.0f} min is refused as stale)")
