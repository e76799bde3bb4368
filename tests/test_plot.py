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
    assert (proc.returncode, proc.stderr) == (2, f"error: no metrics.csv under {tmp_path / 'empty'}: plot needs a run logged with CSVLogger\n")
    assert not (tmp_path / "x.png").exists()


def test_a_row_cut_off_is_skipped_with_a_warning_not_drawn_at_step_0(tmp_path, capsys):
    path = tmp_path / "metrics.csv"
    path.write_text(CSV + "0.9,3.0,0,0.")  # the run stopped while writing step 3's row
    series = read_series(path)
    assert series["reward"] == [(0, 0.1), (1, 0.4), (2, 0.8)] and series["accuracy"] == [(0, 0.25), (1, 0.5), (2, 0.75)]
    assert capsys.readouterr().err == f"warning: {path} line 6: 4 of 10 fields (cut off while written?); row skipped\n"


def test_a_cut_off_number_is_skipped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.csv"
    path.write_text(CSV + "0.9,3.0,0,1.5e,,7.0,3,0.4,0.3,1.8\n,,,,,,,,,\n")
    series = read_series(path)
    assert series["reward"] == [(0, 0.1), (1, 0.4), (2, 0.8)] and series["accuracy"][-1] == (3, 0.9)
    assert capsys.readouterr().err == (f"warning: {path} line 6: reward '1.5e' is not a number; value skipped\n"
                                       f"warning: {path} line 7: step '' is not a step number; row skipped\n")


@pytest.mark.parametrize("text,what", [
    ("", "an empty file"),
    (CSV.splitlines()[0] + "\n", "a header and no rows"),
    (CSV.splitlines()[0] + "\n,,,,,,,,,\n", "none in its 1 rows"),
])
def test_a_csv_with_nothing_to_plot_is_an_error_naming_it(tmp_path, text, what):
    version = tmp_path / "run/logs/version_0"
    version.mkdir(parents=True)
    (version / "metrics.csv").write_text(text)
    proc = subprocess.run([sys.executable, "-m", "arctic_rl.cli", "plot", str(tmp_path / "run")], env=cli_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    message = f"{version / 'metrics.csv'}: no metric values to plot ({what}); plot needs the metrics.csv of a run that logged a step"
    assert (proc.returncode, proc.stdout) == (2, "") and proc.stderr.splitlines()[-1] == f"error: {message}"
    assert not (version / "training_curves.png").exists()
