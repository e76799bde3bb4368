"""Running a recipe's shipped smoke config end to end: its paths resolved as the CLI would, its data
and outputs redirected under a test directory, ``arctic-rl fit`` in a subprocess."""

from __future__ import annotations

import csv
from pathlib import Path

import yaml

from arctic_rl.config_paths import resolve_paths
from tests.helpers import REPO, run_cli


def smoke_config(recipe: str, train_path: Path, root: Path) -> dict:
    """``recipes/<recipe>/smoke.yaml`` reading ``train_path`` and writing under ``root``."""
    path = REPO / "recipes" / recipe / "smoke.yaml"
    config = resolve_paths(yaml.safe_load(path.read_text()), path.parent)
    config["data"]["init_args"]["train_path"] = str(train_path)
    config["trainer"]["default_root_dir"] = str(root)
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(root)
    return config


def run_smoke(config: dict, root: Path) -> list[dict]:
    """Fit ``config``; assert it finished; return the rows of its metrics.csv that have a reward."""
    root.mkdir(parents=True, exist_ok=True)
    proc = run_cli(config, root / "smoke.yaml", timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = config["trainer"]["max_steps"]
    assert f"arctic-rl: {steps} steps" in proc.stdout + proc.stderr
    with open(root / "logs/version_0/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("reward")]
    assert len(rows) == steps
    return rows
