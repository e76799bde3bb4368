"""Config-relative paths: relative paths in a ``--config`` file resolve against that file's
directory, and a task module next to the config imports without ``PYTHONPATH``.

The rule: in a config file, the value of a path key (``PATH_KEYS``: ``train_path``, ``tokenizer``,
``default_root_dir``, ``save_dir``, ``dirpath``, ...) and any string starting with ``./`` or ``../``
is relative to the config file's directory. Other strings are left alone (``model: Qwen/Qwen3-1.7B``
is a hub id; write ``model: ./my_model`` for a local directory). Command-line overrides
(``--data.train_path x``, ``--ckpt_path y``) stay relative to the current directory.

Built-in configs: ``--config NAME`` (``quickstart``), where no file ``NAME`` exists, names
``arctic_rl/builtin/NAME.yaml``, shipped in the package, so it runs with only the wheel installed. In a
built-in config the task's files resolve against the package's ``builtin/`` directory (it carries them),
and the run's outputs (``OUTPUT_KEYS``: ``default_root_dir``, ``save_dir``, ``dirpath``, ...) against the
current directory: ``arctic-rl fit --config quickstart`` writes ``./runs/quickstart``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

PATH_KEYS = frozenset({"train_path", "tokenizer", "default_root_dir", "save_dir", "dirpath", "db_root", "ckpt_path",
                       "root_dir"})  # root_dir: the service's server.root_dir (arctic-rl serve --config)
OUTPUT_KEYS = frozenset({"default_root_dir", "save_dir", "dirpath", "ckpt_path", "root_dir"})
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
# the first line of a config that ``resolve_config_args`` has resolved: Lightning starts the other ranks of a
# several-device run with this process's ``sys.argv``, so they meet ``--config <this YAML>`` and must take it as it is
RESOLVED_MARK = "# arctic-rl: the resolved config of "


def resolved_source(value: str) -> str | None:
    """The file a resolved ``--config`` value (``RESOLVED_MARK``) was made from; None for a path."""
    if not value.startswith(RESOLVED_MARK):
        return None
    return value[len(RESOLVED_MARK):].split("\n", 1)[0]


def config_text(value: str) -> str:
    """A ``--config`` value's YAML: the file's text, or the value itself when it is a resolved config."""
    return value if resolved_source(value) is not None else Path(value).read_text()


def builtin_configs() -> list[str]:
    """The names ``--config NAME`` accepts for the configs shipped in the package."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))


def builtin_config_path(value: str) -> str:
    """``value`` itself when it is a file (or not a built-in name), else the built-in config's path."""
    if resolved_source(value) is not None or os.path.exists(value) or os.sep in value or "/" in value or value.endswith((".yaml", ".yml")):
        return value
    path = BUILTIN_DIR / f"{value}.yaml"
    return str(path) if path.is_file() else value


def missing_config_hint(value: str) -> str:
    """For a ``--config`` value that names no file: the built-in config names, and the close match if any."""
    import difflib

    names = builtin_configs()
    close = difflib.get_close_matches(Path(value).stem, names, n=1)
    hint = f"did you mean --config {close[0]}? " if close else ""
    return f"{hint}the built-in configs are {', '.join(names)}; otherwise give the path of a YAML file"


def builtin_config_args(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config NAME`` of a built-in config replaced by its file's path."""
    out = list(argv)
    for index, path in config_file_args(argv):
        found = builtin_config_path(path)
        if found != path:
            out[index] = found if out[index] == path else f"--config={found}"
    return out


def is_builtin(path: str | Path) -> bool:
    return Path(path).resolve().parent == BUILTIN_DIR


def resolve_paths(node: Any, base: Path, key: str | None = None, output_base: Path | None = None) -> Any:
    """A copy of the parsed YAML ``node`` with its relative paths joined to ``base`` (see the rule);
    with ``output_base`` (built-in configs), the values of ``OUTPUT_KEYS`` are joined to it instead."""
    if isinstance(node, dict):
        return {k: resolve_paths(v, base, k, output_base) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve_paths(v, base, key, output_base) for v in node]
    if isinstance(node, str) and node and _is_relative_path(node, key):
        return os.path.normpath((output_base if output_base is not None and key in OUTPUT_KEYS else base) / node)
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
    dirs = [str(Path(resolved_source(path) or path).resolve().parent) for _, path in config_file_args(argv)]
    return list(dict.fromkeys(dirs))


def resolve_config_args(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config FILE`` replaced by the file's YAML, paths resolved against its
    directory (jsonargparse accepts a YAML string where it takes a config file); each config's
    directory is put on ``sys.path`` so ``class_path: my_task.MyGRPO`` finds ``my_task.py`` beside it."""
    import yaml

    out = list(argv)
    sys.path[:0] = [d for d in config_dirs(argv) if d not in sys.path]
    for index, path in config_file_args(argv):
        if resolved_source(path) is not None:
            continue  # resolved already (a rank Lightning started with this process's arguments)
        base = Path(path).resolve().parent
        config = yaml.safe_load(Path(path).read_text())
        if not isinstance(config, dict):
            continue  # not a mapping: let the CLI report it against the file as before
        output_base = Path.cwd() if is_builtin(path) else None
        text = f"{RESOLVED_MARK}{Path(path).resolve()}\n" + yaml.safe_dump(resolve_paths(config, base, output_base=output_base),
                                                                          sort_keys=False)
        out[index] = text if out[index] == path else f"--config={text}"
    return out
