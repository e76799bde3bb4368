"""Temporary files of a run in one directory per process, which a later run can tell is orphaned.

Every process of a run keeps its temporary files (the rollout engine's copy of the policy weights,
and under ``arctic-rl`` what Python's ``tempfile`` makes while the config is parsed and the trainer
built, W&B's media and artifact staging included) in ``$TMPDIR/arctic-rl-run-<host>-<pid>-<random>/``.
Training itself runs with ``tempfile`` back on ``$TMPDIR``: torch.compile keeps on-disk caches under
``tempfile.gettempdir()`` that must outlive a run (redirected, vLLM's first generate recompiled every
run: 10.4 s instead of 2.4 s for the quickstart). A normal exit, an exception, Ctrl-C and a
SIGTERM remove it (``atexit``); a killed process (``kill -9``, OOM killer) cannot, so ``arctic-rl``
removes at start the directories of this host whose process is gone. A directory whose process is
alive, or that belongs to another host sharing ``$TMPDIR``, is never touched.
"""

from __future__ import annotations

import atexit
import contextlib
import getpass
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

PREFIX = "arctic-rl-run-"
_NAME = re.compile(re.escape(PREFIX) + r"(?P<host>[\w.]+)-(?P<pid>\d+)-\w+")

_base: str | None = None  # $TMPDIR as it was before the CLI pointed tempfile at the run's directory
_owned: tuple[int, Path] | None = None  # (pid, directory): a forked child makes its own


def _user() -> str:
    try:
        return re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # as torch._inductor names it
    except (KeyError, OSError):
        return f"uid_{os.getuid()}"


def host_tag() -> str:
    """This host's name as it appears in run directory names."""
    return re.sub(r"[^\w.]", "_", socket.gethostname())


def base_temp_dir() -> str:
    """The system temporary directory (``$TMPDIR`` or ``/tmp``) the run directories live in."""
    global _base
    if _base is None:
        _base = tempfile.gettempdir()
    return _base


def run_temp_dir() -> Path:
    """This process's temporary directory, made on first use and removed when the process exits."""
    global _owned
    if _owned is None or _owned[0] != os.getpid() or not _owned[1].is_dir():
        path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{host_tag()}-{os.getpid()}-", dir=base_temp_dir()))
        atexit.register(shutil.rmtree, path, True)
        _owned = (os.getpid(), path)
    return _owned[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_dead_runs() -> list[Path]:
    """Delete the run directories of this host whose process no longer exists; return them."""
    removed = []
    for entry in Path(base_temp_dir()).glob(PREFIX + "*"):
        match = _NAME.fullmatch(entry.name)
        if match is None or match["host"] != host_tag() or _alive(int(match["pid"])):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


_redirected_from: list[str | None] = []  # tempfile.tempdir before run_temp_files pointed it at the run


@contextlib.contextmanager
def run_temp_files() -> Iterator[Path]:
    """For the CLI: remove dead runs' directories, then point ``tempfile`` at this process's run
    directory until :func:`release_tempfile` (before training) or the end."""
    removed = remove_dead_runs()
    if removed:
        print(f"arctic-rl: removed {len(removed)} temporary directories left by killed runs in {base_temp_dir()}",
              file=sys.stderr, flush=True)
    _redirected_from.append(tempfile.tempdir)
    tempfile.tempdir = str(run_temp_dir())
    previous = _exit_on_sigterm()
    try:
        yield Path(tempfile.tempdir)
    finally:
        release_tempfile()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm():
    """Until training installs its own handler (``StopOnSigterm``), SIGTERM exits through ``SystemExit``
    (status 143, as a shell reports the signal), so ``atexit`` removes this run's directory: Python's default
    action ends the process at once and left it behind. Returns the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def release_tempfile(stage_wandb: bool = False) -> None:
    """Point ``tempfile`` back at the system directory. ``stage_wandb``: first import the W&B modules
    that make their media and artifact staging directories at import, so those stay in the run's."""
    if not _redirected_from:
        return
    if stage_wandb:
        import wandb.sdk.artifacts.artifact  # noqa: F401  (Artifact._TMP_DIR)
        import wandb.sdk.data_types._private  # noqa: F401  (MEDIA_TMP)
    tempfile.tempdir = _redirected_from.pop()


@contextlib.contextmanager
def engine_start_files() -> Iterator[Path]:
    """While an inference engine starts, point ``tempfile`` at this process's run directory: vLLM puts its
    distributed rendezvous file (``vllm_dist_<uuid>``) in ``tempfile.gettempdir()`` and removes it only on a
    clean shutdown, so a killed run left it in ``$TMPDIR``. torch.compile's cache stays where it was
    (``TORCHINDUCTOR_CACHE_DIR`` is pinned to its default first), since it is meant to outlive runs."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(base_temp_dir(), f"torchinductor_{_user()}"))
    previous, tempfile.tempdir = tempfile.tempdir, str(run_temp_dir())
    try:
        yield Path(tempfile.tempdir)
    finally:
        tempfile.tempdir = previous
