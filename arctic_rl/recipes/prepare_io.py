"""Reading public dataset files (JSON, JSONL, Parquet, or the datasets hub) and writing prompt JSONL,
shared by the recipes' data preparation."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path


def read_records(path: str | Path) -> list[dict]:
    """Rows of a ``.json`` array, a ``.jsonl`` file or a ``.parquet`` file."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_hub_split(name: str, config: str | None, split: str) -> list[dict]:
    """One split of a hub dataset (needs ``datasets`` and internet, or a warm HF cache)."""
    try:
        import datasets
    except ImportError:
        raise SystemExit("the datasets hub needs `pip install datasets`; or pass --source with downloaded files") from None
    return list(datasets.load_dataset(name, config, split=split))


def write_jsonl(rows: Iterable[dict], path: str | Path) -> int:
    """Write ``rows`` one JSON object per line; returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def first_existing(directory: Path, names: list[str]) -> Path | None:
    """The first of ``names`` that exists in ``directory``."""
    return next((directory / n for n in names if (directory / n).exists()), None)
