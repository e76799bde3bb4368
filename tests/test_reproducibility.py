"""Two CPU runs of the same config give bit-identical metrics: the real CLI, a real
vLLM engine, the quickstart's task and model, every logged value compared as written, timings aside.

Before the fix, ZoRRo's gather of each response's predicting state summed a prompt's G repeats with
CPU atomics in no fixed order, so identical runs split into two outcomes from step 0."""

import csv

import pytest

from tests.helpers import cli_in, quickstart_cli_config, write_config

TIMING = ("timing/", "tokens_per_s", "self_check/seconds")  # wall-clock measurements differ by nature


def logged_values(root) -> list[dict[str, str]]:
    with open(root / "logs/version_0/metrics.csv") as f:  # the shared run's later resume tests add version_1
        return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in csv.DictReader(f)]


@pytest.mark.slow
def test_two_runs_of_the_same_config_log_identical_values(quickstart_cli_run, toy_task, tmp_path):
    """The shared 6-step quickstart run against a second run of the same config (its own directory)."""
    first_root, _, _ = quickstart_cli_run
    (tmp_path / "tmp").mkdir()
    second = cli_in(["fit", "--config", str(write_config(quickstart_cli_config(toy_task, tmp_path), tmp_path / "c.yaml"))], tmp_path, tmp_path / "tmp")
    assert second.returncode == 0, second.stderr[-3000:]
    first, second = logged_values(first_root), logged_values(tmp_path)
    assert len(first) >= 6 and {"loss", "grad_norm", "reward", "sampler_logprob_diff"} <= set(first[0])
    for step, (a, b) in enumerate(zip(first, second)):
        assert a == b, f"row {step} differs: {sorted((k, a[k], b.get(k)) for k in a if a[k] != b.get(k))}"
