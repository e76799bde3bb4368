"""Two CPU runs of the same config give bit-identical metrics (issue 12, item 9): the real CLI, a real
vLLM engine, the quickstart's task and model, every logged value compared as written, timings aside.

Before the fix, ZoRRo's gather of each response's predicting state summed a prompt's G repeats with
CPU atomics in no fixed order, so identical runs split into two outcomes from step 0."""

import csv

import pytest

from tests.helpers import quickstart_config, run_cli

TIMING = ("timing/", "tokens_per_s", "self_check/seconds")  # wall-clock measurements differ by nature


def logged_values(root) -> list[dict[str, str]]:
    (path,) = root.glob("logs/version_*/metrics.csv")
    with open(path) as f:
        return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in csv.DictReader(f)]


@pytest.mark.slow
def test_two_runs_of_the_same_config_log_identical_values(toy_task, tmp_path):
    runs = []
    for name in ("first", "second"):
        root = tmp_path / name
        config = quickstart_config(toy_task, root, **{"trainer.max_steps": 6, "trainer.enable_progress_bar": False})
        done = run_cli(config, tmp_path / f"{name}.yaml")
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(logged_values(root))
    first, second = runs
    assert len(first) >= 6 and {"loss", "grad_norm", "reward", "sampler_logprob_diff"} <= set(first[0])
    for step, (a, b) in enumerate(zip(first, second)):
        assert a == b, f"row {step} differs: {sorted((k, a[k], b.get(k)) for k in a if a[k] != b.get(k))}"
