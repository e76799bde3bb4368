"""Atomic checkpoint directories.

A DeepSpeed checkpoint is a directory of several files written by every rank, so it cannot be
written in place atomically. Instead every save goes into a fresh hidden sibling directory
(``.last.ckpt.3f9a1c07``) and, once every rank has finished, the checkpoint's name (``last.ckpt``)
is made a symlink to it with one ``os.replace``, which POSIX guarantees to be atomic. A crash at any
moment leaves ``last.ckpt`` pointing at the previous complete checkpoint (or absent before the
first one), never at a half-written directory; the orphaned staging directory is deleted by the next
successful save of the same name. Staging names never end in ``.ckpt``, so Lightning's
``ckpt_path="last"`` search does not see them.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path


def new_staging_dir(final: str | Path) -> Path:
    """A fresh, not yet existing, hidden sibling of ``final`` to write a checkpoint into."""
    final = Path(final)
    return final.parent / f".{final.name}.{uuid.uuid4().hex[:8]}"


def _is_staging_of(entry: str, final: Path) -> bool:
    return re.fullmatch(re.escape(f".{final.name}.") + r"[0-9a-f]{8}", entry) is not None


def _fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and the directories themselves to disk (a power cut after the
    rename must not expose files whose data never reached the disk)."""
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staging: Path, final: str | Path) -> None:
    """Atomically make ``final`` a symlink to the complete checkpoint directory ``staging``, then delete
    what ``final`` pointed to before and any staging directory of ``final`` left by a crashed save.
    Call on one rank only, after every rank has finished writing into ``staging``."""
    final = Path(final)
    _fsync_tree(staging)
    if final.exists() and not final.is_symlink():
        # a plain file or directory (e.g. written by Lightning's DeepSpeedStrategy): it cannot be swapped
        # atomically for a symlink, so move it aside first (the only non-atomic path, taken once)
        aside = final.with_name(f".{final.name}.replaced")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    link = final.with_name(f".{final.name}.link")
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(staging.name, link)  # relative: the run directory may be moved or copied
    os.replace(link, final)  # the atomic step
    _fsync_dir(final.parent)
    for entry in os.listdir(final.parent):
        if entry != staging.name and (_is_staging_of(entry, final) or entry == f".{final.name}.replaced"):
            _remove_tree(final.parent / entry)


def remove(final: str | Path) -> None:
    """Delete a checkpoint written by :func:`publish` (the symlink and its directory) or a plain one."""
    final = Path(final)
    if final.is_symlink():
        target = final.parent / os.readlink(final)
        final.unlink()
        _remove_tree(target)
    elif final.exists():
        _remove_tree(final)


def _remove_tree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
