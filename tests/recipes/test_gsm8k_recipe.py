"""The GSM8K recipe: preparation of the public format, and the smoke config end to end on CPU."""

import json
from pathlib import Path

import pytest

from arctic_rl.recipes.gsm8k import gsm8k_prompt_row, prepare
from tests.recipes.recipe_smoke import smoke_config

FIXTURES = Path(__file__).parent / "fixtures/gsm8k"


def test_prompt_row_keeps_only_the_gold_number():
    row = gsm8k_prompt_row({"question": " How many? ", "answer": "2,000 + 250 = <<2000+250=2250>>2,250\n#### 2,250"})
    assert row["answer"] == "2250" and row["prompt"].startswith("How many?\n\n") and "####" in row["prompt"]


def smoke_setup(root: Path) -> dict:
    """The fixture rows prepared, the smoke config on them (``recipe_smokes`` fits it)."""
    prepared = prepare(root / "data", FIXTURES)
    return {"config": smoke_config("gsm8k", root / "data/train.jsonl", root / "run"), "root": root / "run",
            "prepared": prepared, "data": root / "data"}


@pytest.mark.slow
def test_prepare_then_fit_the_smoke_config(recipe_smokes):
    smoke = recipe_smokes["gsm8k"]
    assert smoke.setup["prepared"] == {"train": 8, "test": 2}
    rows = [json.loads(line) for line in (smoke.setup["data"] / "train.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["72", "10", "5", "624", "3", "2250", "36", "-2"]
    metrics = smoke.rows()
    assert all(0.0 <= float(m["reward"]) <= 1.0 for m in metrics) and all(m["accuracy"] for m in metrics)


def test_prepare_runs_as_the_recipe_script_and_as_the_cli_from_any_directory(tmp_path):
    import subprocess
    import sys

    from tests.helpers import REPO, cli_env

    commands = {"script": [sys.executable, str(REPO / "recipes/gsm8k/prepare.py")],
                "cli": [sys.executable, "-m", "arctic_rl.cli", "prepare", "gsm8k"]}
    for name, command in commands.items():
        proc = subprocess.run([*command, "--source", str(FIXTURES), "--out", name], cwd=tmp_path, env=cli_env(),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert len((tmp_path / name / "train.jsonl").read_text().splitlines()) == 8
    proc = subprocess.run([*commands["cli"][:-1], "nope"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "arctic-rl prepare {gsm8k,multihop_qa,bird,search_agent}" in proc.stderr
