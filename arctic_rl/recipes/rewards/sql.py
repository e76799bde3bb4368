"""Text-to-SQL execution reward: run the predicted and the gold SQL read-only on the task's SQLite
database and compare the results (1.0 same rows, 0.1 runs but differs, 0.0 otherwise).

A query runs on a ``mode=ro`` URI connection with ``PRAGMA query_only=1``, an authorizer that allows
only reads (no ATTACH, PRAGMA, writes or schema changes), a wall-clock deadline checked by a progress
handler, in-memory temp storage and caps on the rows and bytes fetched. ``SQLWorkerPool``
(``sql_pool.py``) runs it in worker processes with a memory limit and replaces any that hang or die.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote

_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"}
# linear: no \s* before the lazy body (it was quadratic on "```" + 20k spaces); "sqlite" tried before "sql"
_FENCE = re.compile(r"```(?:(?:sqlite|sql)(?=\s))?(.*?)```", re.IGNORECASE | re.DOTALL)
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)

MATCH, EXECUTES, FAILS = 1.0, 0.1, 0.0


@dataclass(frozen=True)
class QueryResult:
    """What one query did: ``ok`` with its rows, ``error`` (SQL error, denied, too large), or ``timeout``."""

    status: Literal["ok", "error", "timeout"]
    rows: tuple[tuple, ...] = ()
    message: str = ""


@dataclass(frozen=True)
class QueryLimits:
    """Per-query limits: wall-clock seconds, rows and total bytes fetched, longest string or blob."""

    timeout_s: float = 5.0
    max_rows: int = 10_000
    max_result_bytes: int = 16 << 20
    max_value_bytes: int = 1 << 20


def _authorize(action: int, arg1, arg2, db_name, trigger) -> int:
    """Reads only: every write, ATTACH, PRAGMA, transaction or schema change is denied."""
    if action not in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def open_readonly(db_path: str, limits: QueryLimits) -> sqlite3.Connection:
    """A connection that can only read ``db_path`` (never creates it), with the guards installed."""
    conn = sqlite3.connect(f"file:{quote(str(db_path))}?mode=ro", uri=True, isolation_level=None, timeout=1.0)
    conn.execute("PRAGMA query_only=1")
    conn.execute("PRAGMA temp_store=MEMORY")  # sorts of huge joins spill into the worker's limited memory, not disk
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, limits.max_value_bytes)
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.set_authorizer(_authorize)
    return conn


def execute_readonly(db_path: str, sql: str, limits: QueryLimits = QueryLimits()) -> QueryResult:
    """Run one statement of ``sql`` on ``db_path`` read-only within ``limits``; never raises for bad SQL."""
    deadline = time.monotonic() + limits.timeout_s
    try:
        conn = open_readonly(db_path, limits)
    except sqlite3.Error as e:
        return QueryResult("error", message=f"cannot open {db_path}: {e}")
    conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)  # nonzero return interrupts
    try:
        return _fetch_capped(conn.execute(sql), limits)
    except sqlite3.OperationalError as e:
        if time.monotonic() > deadline:
            return QueryResult("timeout", message=f"over {limits.timeout_s}s")
        return QueryResult("error", message=str(e))
    except (sqlite3.Error, ValueError, MemoryError, OverflowError) as e:  # Warning: more than one statement
        return QueryResult("error", message=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def _fetch_capped(cursor: sqlite3.Cursor, limits: QueryLimits) -> QueryResult:
    if cursor.description is None:  # empty text or a comment: no query ran, so no result to reward
        return QueryResult("error", message="not a query")
    rows, size = [], 0
    while batch := cursor.fetchmany(512):
        for row in batch:
            size += sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in row)
        rows.extend(batch)
        if len(rows) > limits.max_rows or size > limits.max_result_bytes:
            return QueryResult("error", message=f"result over {limits.max_rows} rows or {limits.max_result_bytes} bytes")
    return QueryResult("ok", rows=tuple(rows))


def _normalise(value):
    return round(value, 6) if isinstance(value, float) else value


def same_result(predicted: tuple[tuple, ...], gold: tuple[tuple, ...], ordered: bool) -> bool:
    """Equal as lists when ``ordered`` (the gold query has ORDER BY), else as multisets of rows."""
    pred = [tuple(map(_normalise, r)) for r in predicted]
    want = [tuple(map(_normalise, r)) for r in gold]
    return pred == want if ordered else Counter(pred) == Counter(want)


def execution_score(predicted: QueryResult, gold: QueryResult, gold_sql: str) -> float:
    """1.0 when the prediction ran and returned the gold rows, 0.1 when it ran but differs, else 0.0."""
    if predicted.status != "ok" or gold.status != "ok":
        return FAILS
    return MATCH if same_result(predicted.rows, gold.rows, ordered=bool(_ORDER_BY.search(gold_sql))) else EXECUTES


def extract_sql(completion: str) -> str:
    """The SQL in a completion: the last fenced ```sql block, else the text after the last ``SQL:``,
    else the whole completion; stripped of a trailing semicolon."""
    fenced = _FENCE.findall(completion)
    if fenced:
        sql = fenced[-1]
    elif "SQL:" in completion:
        sql = completion.rsplit("SQL:", 1)[1]
    else:
        sql = completion
    return sql.strip().rstrip(";").strip()
