"""The BIRD recipe: preparation from the BIRD layout, the task's execution reward through its worker
pool, and the smoke config end to end on CPU with the databases unchanged."""

import csv
import hashlib
import importlib.util
from pathlib import Path

import pytest

from arctic_rl.recipes.bird import BirdSQLGRPO, prepare
from arctic_rl.recipes.prepare_io import read_records
from tests.helpers import REPO
from tests.recipes.recipe_smoke import smoke_config

_spec = importlib.util.spec_from_file_location("make_databases", Path(__file__).parent / "fixtures/bird/make_databases.py")
make_databases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_databases)


@pytest.fixture
def bird(tmp_path):
    """The fixture split built in BIRD's layout and prepared: ``(prepared rows path, database digests)``."""
    source = make_databases.build(tmp_path / "source")
    assert prepare(tmp_path / "data", source) == {"train": 6}
    return tmp_path / "data/train.jsonl", _digests(source)


def _digests(source: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(source.rglob("*.sqlite"))}


def test_prepared_rows_carry_schema_evidence_database_and_gold(bird):
    rows = read_records(bird[0])
    assert [r["db_id"] for r in rows] == ["shop"] * 3 + ["school"] * 3
    assert "CREATE TABLE orders" in rows[1]["prompt"] and "Evidence: total amount refers to SUM(amount)" in rows[1]["prompt"]
    assert Path(rows[0]["db_path"]).is_absolute() and rows[0]["gold_sql"].startswith("SELECT COUNT(*)")


def test_task_reward_runs_the_completions_sql(bird):
    rows = read_records(bird[0])[:2]
    module = BirdSQLGRPO(model={"model_type": "qwen3"}, tokenizer=str(REPO / "data/toy/tokenizer"), sql_workers=1, sql_timeout_s=1.0)
    completions = ["```sql\nSELECT count(*) FROM customers WHERE city = 'Oslo';\n```", "SELECT 1",
                   "```sql\nDROP TABLE orders\n```", "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"]
    db_paths, golds = [rows[0]["db_path"]] * 2 + [rows[1]["db_path"]] * 2, [rows[0]["gold_sql"]] * 2 + [rows[1]["gold_sql"]] * 2
    try:
        assert module.reward([""] * 4, completions, db_path=db_paths, gold_sql=golds) == [1.0, 0.1, 0.0, 0.0]
        assert module.is_correct([""] * 4, completions) == [True, False, False, False]
        assert (module.last_sql_scores.timeouts, module.last_sql_scores.errors) == (1, 1)
    finally:
        module.teardown("fit")
    assert _digests(Path(rows[0]["db_path"]).parents[2]) == bird[1]


def smoke_setup(root: Path) -> dict:
    """The fixture split built and prepared as ``bird`` does, the smoke config on it (``recipe_smokes`` fits it)."""
    source = make_databases.build(root / "source")
    prepared = prepare(root / "data", source)
    return {"config": smoke_config("bird", root / "data/train.jsonl", root / "run"), "root": root / "run",
            "prepared": prepared, "source": source, "digests": _digests(source)}


@pytest.mark.slow
def test_prepare_then_fit_the_smoke_config(recipe_smokes):
    smoke = recipe_smokes["bird"]
    assert smoke.setup["prepared"] == {"train": 6}
    metrics = smoke.rows()
    assert all(0.0 <= float(m["reward"]) <= 1.0 for m in metrics)
    assert all(float(m["reward/sql_timeouts"]) >= 0 and m["reward/sql_errors"] for m in metrics)
    assert _digests(smoke.setup["source"]) == smoke.setup["digests"]
