"""Config-relative paths: relative paths in a ``--config`` file resolve against that file's
directory, and a task module next to the config imports without ``PYTHONPATH``.

The rule: in a config file, the value of a path key (``PATH_KEYS``: ``train_path``, ``tokenizer``,
``default_root_dir``, ``save_dir``, ``dirpath``, ...) and any string starting with ``./`` or ``../``
is relative to the config file's directory. Other strings are left alone (``model: Qwen/Qwen3-1.7B``
is a hub id; write ``model: ./my_model`` for a local directory). Command-line overrides
(``--data.train_path x``, ``--ckpt_path y``) stay relative to the current directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

PATH_KEYS = frozenset({"train_path", "tokenizer", "default_root_dir", "save_dir", "dirpath", "db_root", "ckpt_path",
                       "root_dir"})  # root_dir: the service's server.root_dir (arctic-rl serve --config)


def resolve_paths(node: Any, base: Path, key: str | None = None) -> Any:
    """A copy of the parsed YAML ``node`` with its relative paths joined to ``base`` (see the rule)."""
    if isinstance(node, dict):
        return {k: resolve_paths(v, base, k) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve_paths(v, base, key) for v in node]
    if isinstance(node, str) and node and _is_relative_path(node, key):
        return os.path.normpath(base / node)
    return node


def _is_relative_path(value: str, key: str | None) -> bool:
    if value.startswith(("./", "../")):
        return True
    return key in PATH_KEYS and not os.path.isabs(value) and "://" not in value and not value.startswith("~")


def config_file_args(argv: list[str]) -> list[tuple[int, str]]:
    """``(index of the value, path)`` of each ``--config FILE`` / ``--config=FILE`` in ``argv``."""
    found = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            found.append((i + 1, argv[i + 1]))
        elif arg.startswith("--config="):
            found.append((i, arg.split("=", 1)[1]))
    return found


def config_dirs(argv: list[str]) -> list[str]:
    """The directories of the ``--config`` files in ``argv``, absolute, in order, without repeats."""
    dirs = [str(Path(path).resolve().parent) for _, path in config_file_args(argv)]
    return list(dict.fromkeys(dirs))


def resolve_config_args(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config FILE`` replaced by the file's YAML, paths resolved against its
    directory (jsonargparse accepts a YAML string where it takes a config file); each config's
    directory is put on ``sys.path`` so ``class_path: my_task.MyGRPO`` finds ``my_task.py`` beside it."""
    import yaml

    out = list(argv)
    sys.path[:0] = [d for d in config_dirs(argv) if d not in sys.path]
    for index, path in config_file_args(argv):
        base = Path(path).resolve().parent
        config = yaml.safe_load(Path(path).read_text())
        if not isinstance(config, dict):
            continue  # not a mapping: let the CLI report it against the file as before
        text = yaml.safe_dump(resolve_paths(config, base), sort_keys=False)
        out[index] = text if out[index] == path else f"--config={text}"
    return out
