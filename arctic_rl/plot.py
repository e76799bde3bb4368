"""``arctic-rl plot RUN_DIR``: one PNG of a run's training curves from its CSVLogger ``metrics.csv``
(reward, accuracy, response length, KL and entropy, timing, ZoRRo dedup ratio, and the staleness and partial samples of
asynchronous rollouts, over steps).

    arctic-rl plot runs/quickstart                       # newest metrics.csv under the directory
    arctic-rl plot runs/quickstart/logs/version_0 --out curves.png
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

from arctic_rl.errors import ConfigError, exit_on_config_error

PANELS = {  # title -> metrics drawn in it (those the run logged)
    "reward": ["reward", "reward/std"],
    "accuracy": ["accuracy"],
    "response length (tokens)": ["response_length/mean", "response_length/max"],
    "KL / entropy": ["kl", "entropy"],
    "timing (s)": ["timing/rollout_s", "timing/train_s", "timing/sync_s", "timing/rollout_wait_s", "timing/engine_idle_s"],
    "ZoRRo dedup ratio": ["zorro/dedup_ratio"],
    "staleness (rollout batches)": ["rollout/staleness", "stream/staleness_mean"],
    "rollout stream": ["stream/partial_token_frac", "stream/partial_sample_frac"],
    "rollout stream groups": ["stream/buffered_groups", "stream/in_flight_groups", "stream/regenerated_groups", "stream/dropped_groups"],
}


def find_metrics_csv(run_dir: Path) -> Path:
    """``run_dir/metrics.csv``, else the newest ``metrics.csv`` below ``run_dir``."""
    if (run_dir / "metrics.csv").exists():
        return run_dir / "metrics.csv"
    found = sorted(run_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise ConfigError(f"no metrics.csv under {run_dir}: plot needs a run logged with CSVLogger")
    return found[-1]


def read_series(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Each metric's ``(step, value)`` points; CSVLogger spreads one step over several rows. A row cut
    off (a run stopped while writing it) and a value that is not a number are skipped with a warning
    naming the line; a file with no values to plot is a ``ConfigError`` naming it."""
    series: dict[str, list[tuple[int, float]]] = {}
    rows = 0
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is not None and "step" not in header:
                raise ConfigError(f"{path} line 1: no 'step' column; plot reads the metrics.csv CSVLogger writes")
            for row in filter(None, reader):
                rows += 1
                _add_row(series, header, row, f"{path} line {reader.line_num}")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a text CSV file (byte {e.start} is not UTF-8)") from e
    if not series:
        what = "an empty file" if header is None else "a header and no rows" if rows == 0 else f"none in its {rows} rows"
        raise ConfigError(f"{path}: no metric values to plot ({what}); plot needs the metrics.csv of a run that logged a step")
    return series


def _add_row(series: dict[str, list[tuple[int, float]]], header: list[str], row: list[str], where: str) -> None:
    if len(row) != len(header):
        _warn(f"{where}: {len(row)} of {len(header)} fields (cut off while written?); row skipped")
        return
    values = dict(zip(header, row))
    step = _number(values["step"])
    if step is None or not step.is_integer():
        _warn(f"{where}: step {values['step']!r} is not a step number; row skipped")
        return
    for name, value in values.items():
        if name in ("step", "epoch") or value == "":
            continue
        number = _number(value)
        if number is None:
            _warn(f"{where}: {name} {value!r} is not a number; value skipped")
        elif math.isfinite(number):
            series.setdefault(name, []).append((int(step), number))


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's curves to ``out`` (default: ``training_curves.png`` beside metrics.csv)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = find_metrics_csv(Path(run_dir))
    series = read_series(path)
    fig, axes = plt.subplots(math.ceil(len(PANELS) / 3), 3, figsize=(15, 4 * math.ceil(len(PANELS) / 3)), constrained_layout=True)
    for ax, (title, names) in zip(axes.flat, PANELS.items()):
        drawn = [n for n in names if n in series]
        for name in drawn:
            steps, values = zip(*series[name])
            ax.plot(steps, values, label=name, marker="." if len(steps) < 30 else None)
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title)
        ax.set_xlabel("step")
    fig.suptitle(str(path.parent))
    out = Path(out) if out else path.parent / "training_curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="arctic-rl plot", description="Plot a run's training curves to a PNG.")
    parser.add_argument("run_dir", help="a run directory, or a CSVLogger version directory")
    parser.add_argument("--out", help="PNG path (default: training_curves.png beside metrics.csv)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit('error: arctic-rl plot needs matplotlib: pip install -e ".[plot]"') from None
    with exit_on_config_error():  # a missing, empty or unreadable metrics.csv: one line naming it, exit status 2
        print(plot_run(args.run_dir, args.out))
