"""What a ``save_state``, ``load_state`` or ``export`` path may name: :func:`check_target` checks a request's
path once, before anything touches the disk, and :func:`write_manifest` marks each folder the service writes.

The rules, at every ZeRO stage:
    - the path lies under ``server.root_dir`` and is not the root itself (403, ``PathRefused``);
    - ``save_state`` and ``export`` write a folder: a new one, or one the service wrote before for the same
      operation (it holds :data:`MANIFEST`); an existing file or folder of anyone else, or a path inside a
      folder the service wrote, is refused (403) and left as it was;
    - ``load_state`` reads only a folder ``save_state`` wrote (400 for anything else: a plain folder, a file);
    - a path too long for the file system is a client mistake (400).
Messages name the client's path as given, never the server's absolute layout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from arctic_rl.serve.errors import PathRefused, RequestError
from arctic_rl.serve.security import confine_path

MANIFEST = "arctic-rl-service.json"  # in every folder the service wrote: {"kind": "state" | "export", ...}
STATE_FILE = "state.ckpt"  # the checkpoint inside a save_state folder (a file, or a ZeRO checkpoint's symlink)
KIND_OF_OPERATION = {"save_state": "state", "load_state": "state", "export": "export"}
MAX_PATH_CHARS = 1024  # a request's path, as sent
MAX_NAME_BYTES = 255  # one path component (NAME_MAX of Linux file systems)


def check_target(root: str | Path, requested: str, operation: str, zero_stage: int, world_size: int = 1,
                 lora_rank: int = 0) -> Path:
    """The folder ``requested`` names under ``root`` for ``operation``, after every rule above.

    Args:
        root: ``server.root_dir`` (created when missing).
        requested: the request's path, relative to ``root``.
        operation: ``save_state``, ``load_state`` or ``export``.
        zero_stage: the job's ``training.zero_stage``; a state saved at stage 0 and one saved under ZeRO
            (1-3) are different formats, so ``load_state`` refuses to cross between them.
        world_size: the job's training ranks (``training.devices``); ``load_state`` of a ZeRO state needs the
            number of ranks that saved it (each wrote its own optimizer shard).
        lora_rank: the job's ``lora.rank`` (0: no LoRA); ``load_state`` needs a state of the same rank (a LoRA
            state holds adapters only, of one rank; any other holds every weight).

    Raises:
        PathRefused: (403) outside ``root``, ``root`` itself, something the service did not write, or a path
            inside a folder it wrote.
        RequestError: (400) a path too long, or ``load_state`` of anything but a saved state.
    """
    kind = KIND_OF_OPERATION[operation]
    _check_length(requested)
    target = confine_path(root, requested)
    base = confine_path(root, ".")
    if target == base:
        raise PathRefused(f"path {requested!r} is the server's root_dir itself; name a folder under it (e.g. 'states/step_1')")
    for folder in reversed(target.relative_to(base).parents[:-1]):  # the folders between the root and the target
        if (base / folder).exists() and not (base / folder).is_dir():
            raise PathRefused(f"path {requested!r}: {folder.as_posix()!r} is a file, not a folder")
        if (base / folder / MANIFEST).exists():
            raise PathRefused(f"path {requested!r} is inside {folder.as_posix()!r}, a folder the service wrote; name a path beside it")
    written = read_manifest(target)
    if operation == "load_state":
        _check_loadable(requested, target, written, zero_stage, world_size)
        _check_lora(requested, written, lora_rank)
    elif target.exists() or target.is_symlink():
        if written is None:
            raise PathRefused(f"path {requested!r} already exists and the service did not write it; {operation} "
                              "only creates a new folder or replaces one it wrote")
        if written.get("kind") != kind:
            raise PathRefused(f"path {requested!r} holds a {written.get('kind')} the service wrote, not a {kind}; name another path")
    return target


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest the service left in ``folder``, or None when there is none (or it is not one of ours)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("kind") in ("state", "export") else None


def write_manifest(folder: Path, kind: str, **info: Any) -> None:
    """Mark ``folder`` as written by the service (``kind``: ``state`` or ``export``), atomically."""
    partial = folder / f".{MANIFEST}.partial"
    partial.write_text(json.dumps({"kind": kind, **info}))
    os.replace(partial, folder / MANIFEST)


def _check_length(requested: str) -> None:
    if isinstance(requested, str) and len(requested) > MAX_PATH_CHARS:
        raise RequestError(f"path is {len(requested)} characters long; at most {MAX_PATH_CHARS}")
    for name in requested.split("/") if isinstance(requested, str) else ():
        if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise RequestError(f"path has a component of {len(name.encode('utf-8', 'surrogatepass'))} bytes "
                               f"({name[:20]!r}...); at most {MAX_NAME_BYTES}")


def _check_loadable(requested: str, target: Path, written: dict[str, Any] | None, zero_stage: int, world_size: int) -> None:
    if not target.exists():
        raise RequestError(f"path {requested!r}: no saved state there")
    if written is None or written.get("kind") != "state" or not (target / STATE_FILE).exists():
        what = "a file" if target.is_file() else "a folder save_state did not write"
        raise RequestError(f"path {requested!r} is {what}, not a saved state; load_state reads what save_state wrote")
    saved_stage = written.get("zero_stage")
    if not isinstance(saved_stage, int) or (saved_stage == 0) != (zero_stage == 0):
        raise RequestError(f"path {requested!r} was saved with training.zero_stage={saved_stage}; this job trains with "
                           f"zero_stage={zero_stage} (a stage-0 state and a ZeRO state do not load into each other)")
    saved_ranks = written.get("world_size", 1)
    if zero_stage and saved_ranks != world_size:
        raise RequestError(f"path {requested!r} was saved by {saved_ranks} training ranks; this job has "
                           f"{world_size} (each rank wrote its own ZeRO shard)")


def _check_lora(requested: str, written: dict[str, Any], lora_rank: int) -> None:
    saved = written.get("lora_rank")  # absent: a state written before the manifest recorded it (not checked)
    if isinstance(saved, int) and saved != lora_rank:
        def trains(rank: int) -> str:
            return f"LoRA adapters of rank {rank}" if rank else "all weights (no LoRA)"

        raise RequestError(f"path {requested!r} holds {trains(saved)} (lora.rank={saved}); this job trains {trains(lora_rank)} "
                           f"(lora.rank={lora_rank}): load it into a server started with lora.rank: {saved}")
