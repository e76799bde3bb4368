"""``arctic-rl plot``: a run's metrics.csv (CSVLogger's layout) to a PNG."""

import subprocess
import sys

import pytest

from arctic_rl.plot import read_series
from tests.helpers import REPO, cli_env

pytest.importorskip("matplotlib")

CSV = """accuracy,entropy,epoch,reward,reward/epoch_mean,response_length/mean,step,timing/rollout_s,timing/train_s,zorro/dedup_ratio
0.25,3.4,0,0.1,,12.0,0,0.5,0.2,1.5
0.5,3.1,0,0.4,,10.0,1,0.4,0.2,1.6
,,0,,0.25,,1,,,
0.75,nan,0,0.8,,8.0,2,0.4,0.3,1.7
"""


def test_series_per_metric_skip_blanks_and_nan(tmp_path):
    (tmp_path / "metrics.csv").write_text(CSV)
    series = read_series(tmp_path / "metrics.csv")
    assert series["reward"] == [(0, 0.1), (1, 0.4), (2, 0.8)]
    assert series["reward/epoch_mean"] == [(1, 0.25)]
    assert series["entropy"] == [(0, 3.4), (1, 3.1)]
    assert "epoch" not in series and "step" not in series


def test_cli_writes_a_png_from_a_run_directory_and_refuses_one_without_metrics(tmp_path):
    version = tmp_path / "run/logs/version_0"
    version.mkdir(parents=True)
    (version / "metrics.csv").write_text(CSV)
    run = [sys.executable, "-m", "arctic_rl.cli", "plot"]
    proc = subprocess.run([*run, str(tmp_path / "run")], env=cli_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    png = version / "training_curves.png"
    assert proc.stdout.strip() == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    proc = subprocess.run([*run, str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")], env=cli_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "no metrics.csv under" in proc.stderr and not (tmp_path / "x.png").exists()
