"""The BIRD text-to-SQL recipe: data preparation from the BIRD archives (``train.json`` or
``dev.json`` and their SQLite databases) and the GRPO task rewarding SQL by execution match
(``rewards/sql.py``), its queries run in a sandboxed worker pool (``rewards/sql_pool.py``).

    python recipes/bird/prepare.py --source path/to/train --out recipes/bird/data
"""

from __future__ import annotations

import argparse
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import quote

from arctic_rl.errors import ConfigError, exit_on_config_error
from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.recipes.prepare_io import convert_records, first_existing, iter_records, write_jsonl
from arctic_rl.recipes.rewards.sql import QueryLimits, extract_sql
from arctic_rl.recipes.rewards.sql_pool import SQLScores, SQLWorkerPool, score_sql

INSTRUCTION = ("Write one SQLite query that answers the question. Think briefly, then give the query in a"
               " ```sql code block.")


def database_path(db_dir: Path, db_id: str) -> Path:
    """BIRD's layout: ``<split>_databases/<db_id>/<db_id>.sqlite``."""
    return db_dir / db_id / f"{db_id}.sqlite"


def schema_text(db_path: Path) -> str:
    """The ``CREATE TABLE`` statements of a database, read without modifying it; ``ConfigError`` naming
    the file when it is not a readable SQLite database."""
    conn = sqlite3.connect(f"file:{quote(str(db_path))}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL ORDER BY name").fetchall()
    except sqlite3.DatabaseError as e:
        raise ConfigError(f"{db_path} is not a readable SQLite database ({e}); unpack BIRD's databases archive again") from e
    finally:
        conn.close()
    return "\n".join(sql.strip() + ";" for (sql,) in rows)


def bird_prompt_row(record: dict, db_path: Path, schema: str) -> dict:
    """A BIRD record (``db_id``, ``question``, ``evidence``, ``SQL``) -> ``{"prompt", "db_path",
    "gold_sql", "db_id"}``."""
    evidence = record.get("evidence", "").strip()
    hint = f"\nEvidence: {evidence}" if evidence else ""
    prompt = f"Database schema:\n{schema}\n\nQuestion: {record['question'].strip()}{hint}\n{INSTRUCTION}"
    return {"prompt": prompt, "db_path": str(db_path), "gold_sql": record["SQL"], "db_id": record["db_id"]}


def prepare(out_dir: str | Path, source: str | Path, split: str = "train") -> dict[str, int]:
    """Write ``<split>.jsonl`` under ``out_dir`` from an unpacked BIRD ``source`` directory holding
    ``<split>.json`` and ``<split>_databases/``; rows name their database by absolute path. A record
    missing a field, or a database that is missing or corrupt, is a ``ConfigError`` naming it; the
    previous file stays as it was."""
    source = Path(source).resolve()
    questions = first_existing(source, [f"{split}.json", f"{split}.jsonl"])
    db_dir = first_existing(source, [f"{split}_databases", "databases"])
    if questions is None or db_dir is None:
        raise ConfigError(f"--source {source}: expected {split}.json and {split}_databases/ (unpack BIRD's {split}.zip and its databases zip)")
    schemas: dict[str, str] = {}

    def prompt_row(record: dict) -> dict:
        path = database_path(db_dir, record["db_id"])
        if not path.exists():
            raise ConfigError(f"database {record['db_id']!r} not found at {path}")
        if record["db_id"] not in schemas:
            schemas[record["db_id"]] = schema_text(path)
        return bird_prompt_row(record, path, schemas[record["db_id"]])

    return {split: write_jsonl(convert_records(iter_records(questions), prompt_row), Path(out_dir) / f"{split}.jsonl")}


class BirdSQLGRPO(GRPOModule):
    """GRPO on BIRD: the completion's last ```sql block runs read-only on the row's database; reward
    1.0 when its rows equal the gold query's (as a multiset; in order when the gold has ORDER BY), 0.1
    when it runs but differs, 0.0 when it fails, is denied or times out. Timeouts and errors are
    logged per step (``reward/sql_timeouts``, ``reward/sql_errors``).

    Args:
        sql_workers: worker processes running queries.
        sql_timeout_s: wall-clock limit of one query.
        sql_memory_mb: address-space limit of each worker.
        sql_max_rows: a result with more rows scores 0.
        **kwargs: ``GRPOModule``'s arguments.
    """

    def __init__(self, *args: Any, sql_workers: int = 4, sql_timeout_s: float = 5.0, sql_memory_mb: int = 2048,
                 sql_max_rows: int = 100_000, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sql_workers, self.sql_memory_mb = sql_workers, sql_memory_mb
        self.sql_limits = QueryLimits(timeout_s=sql_timeout_s, max_rows=sql_max_rows)
        self._sql_pool: SQLWorkerPool | None = None
        self.last_sql_scores: SQLScores | None = None

    def reward(self, prompts: list[str], completions: list[str], db_path: list[str], gold_sql: list[str], **columns) -> list[float]:
        if self._sql_pool is None:
            self._sql_pool = SQLWorkerPool(self.sql_workers, self.sql_limits, self.sql_memory_mb)
        self.last_sql_scores = score_sql(self._sql_pool, db_path, [extract_sql(c) for c in completions], gold_sql)
        return self.last_sql_scores.scores

    def is_correct(self, prompts: list[str], completions: list[str], **columns) -> list[bool]:
        return [s == 1.0 for s in self.last_sql_scores.scores]  # reward ran on this very batch just before

    def training_step(self, batch: dict[str, Any], batch_idx: int):
        loss = super().training_step(batch, batch_idx)
        if self.last_sql_scores is not None:
            s = self.last_sql_scores
            self.log_dict({"reward/sql_timeouts": float(s.timeouts), "reward/sql_errors": float(s.errors),
                           "reward/sql_gold_failures": float(s.gold_failures)}, batch_size=len(s.scores))
        return loss

    def teardown(self, stage: str) -> None:
        if self._sql_pool is not None:
            self._sql_pool.close()
            self._sql_pool = None
        super().teardown(stage)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="arctic-rl prepare bird", description="Prepare BIRD text-to-SQL prompts for arctic-rl.")
    parser.add_argument("--source", required=True, help="unpacked BIRD split: <split>.json and <split>_databases/")
    parser.add_argument("--out", required=True, help="output directory (<split>.jsonl)")
    parser.add_argument("--split", default="train", help="train or dev")
    args = parser.parse_args(argv)
    with exit_on_config_error():  # a bad input: one line naming it, exit status 2
        print(prepare(args.out, args.source, args.split))
