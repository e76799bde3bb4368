"""Running the recipes' shipped smoke configs end to end: each one's paths resolved as the CLI would, its data and
outputs redirected under a test directory, ``arctic-rl fit`` in a process of its own. The recipes' runs are made once
per session, together (``recipe_smokes`` in ``tests/recipes/conftest.py``): each process is forked from one that
imported the CLI's dependencies once (``run_cli_many``, ``tests/cli_forks.py``), and each recipe's test reads its own."""

from __future__ import annotations

import csv
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from arctic_rl.config_paths import resolve_paths
from tests.helpers import REPO, run_cli_many, write_config

SMOKE_LIMIT_S = 240  # one recipe's run, on a loaded 2-core machine


def smoke_config(recipe: str, train_path: Path, root: Path) -> dict:
    """``recipes/<recipe>/smoke.yaml`` reading ``train_path`` and writing under ``root``."""
    path = REPO / "recipes" / recipe / "smoke.yaml"
    config = resolve_paths(yaml.safe_load(path.read_text()), path.parent)
    config["data"]["init_args"]["train_path"] = str(train_path)
    config["trainer"]["default_root_dir"] = str(root)
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(root)
    return config


@dataclass
class Smoke:
    """One recipe's smoke run: its config, its output root, what the recipe's ``smoke_setup`` reported, the process."""

    config: dict
    root: Path
    setup: dict
    proc: subprocess.CompletedProcess

    def rows(self) -> list[dict]:
        """Assert the run finished; the rows of its metrics.csv that have a reward."""
        assert self.proc.returncode == 0, self.proc.stderr[-4000:]
        steps = self.config["trainer"]["max_steps"]
        assert f"arctic-rl: {steps} steps" in self.proc.stdout + self.proc.stderr
        with open(self.root / "logs/version_0/metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("reward")]
        assert len(rows) == steps
        return rows


def fit_smokes(setups: dict[str, dict], workdir: Path) -> dict[str, Smoke]:
    """Fit each ``{recipe: {"config": ..., "root": ..., **reported}}`` (``arctic-rl fit --config``, two at a time)."""
    commands = {}
    for name, setup in setups.items():
        setup["root"].mkdir(parents=True, exist_ok=True)
        commands[name] = ["fit", "--config", str(write_config(setup["config"], setup["root"] / "smoke.yaml"))]
    done = run_cli_many(commands, workdir, timeout=SMOKE_LIMIT_S * len(commands) + 120, limit_s=SMOKE_LIMIT_S)
    return {name: Smoke(setup["config"], setup["root"], setup, done[name]) for name, setup in setups.items()}
