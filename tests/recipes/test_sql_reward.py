"""SQL execution reward: result comparison, SQL extraction, and malicious or runaway queries scoring 0
within the timeout while the database stays byte-for-byte the same."""

import hashlib
import os
import signal
import sqlite3
import time

import pytest

from arctic_rl.recipes.rewards.sql import QueryLimits, execute_readonly, execution_score, extract_sql
from arctic_rl.recipes.rewards.sql_pool import SQLWorkerPool, score_sql

LIMITS = QueryLimits(timeout_s=0.5, max_rows=1000)
COUNT_USERS = "SELECT count(*) FROM users"
ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"
CROSS_JOIN = "SELECT count(*) FROM big a, big b, big c, big d"
MILLIONS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 3000000) SELECT x FROM c"


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """A tiny database: users(id, name, age), big(n) with 1,000 rows."""
    path = tmp_path_factory.mktemp("sql") / "shop.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT, age INTEGER)")
        conn.executemany("INSERT INTO users VALUES (?, ?, ?)", [(1, "ann", 31), (2, "bob", 25), (3, "cy", 31)])
        conn.execute("CREATE TABLE big (n INTEGER)")
        conn.executemany("INSERT INTO big VALUES (?)", [(i,) for i in range(1000)])
    conn.close()
    return str(path)


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("pred,gold,score", [
    ("SELECT name FROM users WHERE age = 31", "SELECT name FROM users WHERE age = 31", 1.0),
    ("SELECT name FROM users WHERE age = 31 ORDER BY name DESC", "SELECT name FROM users WHERE age > 30", 1.0),  # multiset
    ("SELECT name FROM users ORDER BY name DESC", "SELECT name FROM users ORDER BY name", 0.1),  # gold orders
    ("SELECT name FROM users ORDER BY name", "SELECT name FROM users ORDER BY name", 1.0),
    ("SELECT age FROM users", "SELECT DISTINCT age FROM users", 0.1),  # multisets, not sets
    ("SELECT avg(age) FROM users", "SELECT sum(age) / 3.0 FROM users", 1.0),  # float rounding
    ("SELECT nme FROM users", "SELECT name FROM users", 0.0),
    ("SELECT name FROM users", "SELECT broken FROM users", 0.0),
    ("", "SELECT name FROM users WHERE age > 99", 0.0),  # no query is not an empty result
    ("-- SELECT name FROM users", "SELECT name FROM users WHERE age > 99", 0.0),
    ("SELECT name FROM users WHERE age > 99", "SELECT name FROM users WHERE age > 99", 1.0),  # both empty
])
def test_execution_score(db, pred, gold, score):
    assert execution_score(execute_readonly(db, pred, LIMITS), execute_readonly(db, gold, LIMITS), gold) == score


@pytest.mark.parametrize("completion,sql", [
    ("Let me think.\n```sql\nSELECT 1;\n```\nDone", "SELECT 1"),
    ("```sql\nSELECT 1\n```\nbetter:\n```SQL\nSELECT 2\n```", "SELECT 2"),
    ("reasoning\nSQL: SELECT name FROM t;", "SELECT name FROM t"),
    ("SELECT 3", "SELECT 3"),
    ("```sqlite\nSELECT 4\n```", "SELECT 4"),  # was "ite\nSELECT 4": "sql" matched first
    ("```SELECT 5```", "SELECT 5"),
])
def test_extract_sql(completion, sql):
    assert extract_sql(completion) == sql


LONG = {  # name -> (completion, extracted SQL): the first two took seconds to minutes with \s* before the lazy body
    "fence then 80k spaces": ("```" + " " * 80_000, "```"),  # no closing fence: the whole completion, stripped
    "sql fence then 40k blank lines": ("```sql" + " \n" * 40_000, "```sql"),
    "20k empty fences": ("```sql\n```" * 20_000 + "SELECT 6", ""),  # the last fenced block
}


@pytest.mark.timeout(5)  # milliseconds each now
@pytest.mark.parametrize("name", LONG)
def test_extract_sql_is_linear_time(name):
    completion, sql = LONG[name]
    assert extract_sql(completion) == sql


MALICIOUS = {
    "drop": "DROP TABLE users",
    "delete": "DELETE FROM users",
    "insert": "INSERT INTO users VALUES (9, 'eve', 1)",
    "update": "UPDATE users SET age = 0",
    "create temp": "CREATE TEMP TABLE t (x)",
    "attach": "ATTACH DATABASE ':memory:' AS other",
    "writable_schema": "PRAGMA writable_schema = 1",
    "journal_mode": "PRAGMA journal_mode = WAL",
    "pragma read": "SELECT * FROM pragma_table_info('users')",
    "begin": "BEGIN EXCLUSIVE",
    "vacuum into": "VACUUM INTO 'copy.sqlite'",
    "two statements": "SELECT 1; DROP TABLE users",
    "load_extension": "SELECT load_extension('evil')",
    "huge blob": "SELECT randomblob(100000000)",
    "millions of rows": MILLIONS,
    "cross join rows": "SELECT * FROM big a, big b",
    "huge string": "SELECT group_concat(a.n) FROM big a, big b",
    "endless recursive cte": ENDLESS,
    "huge cross join": CROSS_JOIN,
}


def test_malicious_queries_fail_in_process_and_leave_the_database_unchanged(db, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where VACUUM INTO would write
    before = _digest(db)
    for name, sql in MALICIOUS.items():
        start = time.monotonic()
        result = execute_readonly(db, sql, LIMITS)
        assert result.status != "ok", (name, result)
        assert time.monotonic() - start < LIMITS.timeout_s + 0.5, name
    assert execute_readonly(db, ENDLESS, LIMITS).status == "timeout"
    assert _digest(db) == before and sorted(os.listdir(tmp_path)) == []
    assert execute_readonly(db, COUNT_USERS, LIMITS).rows == ((3,),)
    assert execute_readonly(str(tmp_path / "missing.sqlite"), "SELECT 1", LIMITS).status == "error"
    assert not (tmp_path / "missing.sqlite").exists()  # read-only open never creates a database


def test_pool_scores_a_malicious_batch_zero_counts_timeouts_and_keeps_the_database(db):
    before = _digest(db)
    preds = [COUNT_USERS, "SELECT 4", *MALICIOUS.values()]
    with SQLWorkerPool(num_workers=2, limits=LIMITS, memory_mb=512) as pool:
        start = time.monotonic()
        report = score_sql(pool, [db] * len(preds), preds, [COUNT_USERS] * len(preds))
        elapsed = time.monotonic() - start
    assert report.scores == [1.0, 0.1] + [0.0] * len(MALICIOUS)
    assert (report.timeouts, report.errors, report.gold_failures) == (2, len(MALICIOUS) - 2, 0)  # CTE and cross join
    assert elapsed < 6, elapsed
    assert _digest(db) == before


def test_a_hung_worker_is_killed_and_replaced_and_a_dead_one_too(db):
    with SQLWorkerPool(num_workers=1, limits=QueryLimits(timeout_s=0.2)) as pool:
        os.kill(pool.workers.pids[0], signal.SIGSTOP)  # hangs without reaching its own deadline
        assert pool.run([(db, COUNT_USERS)])[0].status == "timeout"
        assert pool.replaced == 1
        os.kill(pool.workers.pids[0], signal.SIGKILL)
        time.sleep(0.1)
        assert pool.run([(db, COUNT_USERS), (db, COUNT_USERS)])[1].rows == ((3,),)
        assert pool.replaced == 2
