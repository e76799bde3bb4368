"""Reading public dataset files (JSON, JSONL, Parquet, or the datasets hub) and writing prompt JSONL,
shared by the recipes' data preparation.

A bad input is a ``ConfigError`` naming the file and the line or record (``arctic-rl prepare`` prints
it as one line and exits with status 2), and the output files are written all or nothing: a failed
run leaves the previous output as it was (``write_jsonl_files``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from arctic_rl.errors import ConfigError

Labelled = tuple[str, dict]  # ("train.jsonl line 5", record): where a record came from, for error messages


def iter_records(path: str | Path) -> Iterator[Labelled]:
    """``(label, record)`` of each row of a ``.json`` array, a ``.jsonl`` file or a ``.parquet`` file;
    the label names the file and the line (JSONL), record (JSON array) or row (Parquet), from 1."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: {'not a file' if path.exists() else 'no such file'}; give a .json, .jsonl or .parquet file")
    if path.suffix == ".parquet":
        yield from ((f"{path} row {i}", r) for i, r in enumerate(_read_parquet(path), 1))
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})") from e
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} line {e.lineno} column {e.colno}: not valid JSON ({e.msg}); is the file complete?") from e
        yield from ((f"{path} record {i}", _object(r, f"{path} record {i}")) for i, r in enumerate(records, 1))
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} line {lineno}: not valid JSON ({e.msg}); fix or remove that line") from e
            yield f"{path} line {lineno}", _object(record, f"{path} line {lineno}")


def _object(record, label: str) -> dict:
    if not isinstance(record, dict):
        raise ConfigError(f"{label}: expected a JSON object per record, got {type(record).__name__}")
    return record


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pyarrow.ArrowInvalid, OSError) as e:
        raise ConfigError(f"{path}: not a readable Parquet file ({e})") from e


def read_records(path: str | Path) -> list[dict]:
    """Rows of a ``.json`` array, a ``.jsonl`` file or a ``.parquet`` file."""
    return [record for _, record in iter_records(path)]


def require_records(records: Iterable[Labelled], source: str | Path) -> list[Labelled]:
    """``records`` as a list; none at all is a ``ConfigError`` naming ``source``."""
    records = list(records)
    if not records:
        raise ConfigError(f"{source}: holds no records (an empty file or array); --source needs at least one")
    return records


def convert_records(records: Iterable[Labelled], convert: Callable[[dict], dict]) -> Iterator[dict]:
    """``convert(record)`` of each labelled record; a record it cannot convert (a missing field, a bad
    value) is a ``ConfigError`` naming the record."""
    for label, record in records:
        try:
            yield convert(record)
        except ConfigError as e:
            raise ConfigError(f"{label}: {e}") from e
        except KeyError as e:
            raise ConfigError(f"{label}: the record has no {e.args[0]!r} field; fix or remove that record") from e
        except (ValueError, TypeError, AttributeError) as e:
            raise ConfigError(f"{label}: {e}; fix or remove that record") from e


def load_hub_split(name: str, config: str | None, split: str) -> list[Labelled]:
    """One split of a hub dataset, labelled (needs ``datasets`` and internet, or a warm HF cache)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("the datasets hub needs `pip install datasets`; or pass --source with downloaded files") from None
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline, not cached, hub unreachable: datasets raises many types
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"could not load {name} ({split}) from the Hugging Face hub ({type(e).__name__}: {reason});"
                          " download the dataset's files and pass them with --source (see the recipe's README)") from e
    return [(f"{name} {split} row {i}", r) for i, r in enumerate(rows, 1)]


def write_jsonl_files(out_dir: str | Path, files: dict[str, Iterable[dict]]) -> dict[str, int]:
    """Write each ``name -> rows`` to ``out_dir/name``, one JSON object per line; returns the row count
    per name. All or nothing: the rows go to temporary files beside their targets, renamed over them
    only once every file is complete, so a run that fails (a bad record, Ctrl-C, a full disk) leaves
    the previous files byte for byte as they were."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    temps: dict[Path, Path] = {}
    counts = {}
    try:
        for name, rows in files.items():
            target = out_dir / name
            temps[target] = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            with open(temps[target], "w", encoding="utf-8") as f:
                counts[name] = sum(f.write(json.dumps(row, ensure_ascii=False) + "\n") > 0 for row in rows)
        for target, temp in temps.items():
            os.replace(temp, target)
    finally:
        for temp in temps.values():
            temp.unlink(missing_ok=True)
    return counts


def write_jsonl(rows: Iterable[dict], path: str | Path) -> int:
    """Write ``rows`` one JSON object per line to ``path`` (all or nothing); returns how many."""
    path = Path(path)
    return write_jsonl_files(path.parent, {path.name: rows})[path.name]


def first_existing(directory: Path, names: list[str]) -> Path | None:
    """The first of ``names`` that exists in ``directory``."""
    return next((directory / n for n in names if (directory / n).exists()), None)
