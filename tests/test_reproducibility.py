"""Two CPU runs of the same config give bit-identical metrics: the real CLI, a real
vLLM engine, the quickstart's task and model, every logged value compared as written, timings aside.

Before the fix, ZoRRo's gather of each response's predicting state summed a prompt's G repeats with
CPU atomics in no fixed order, so identical runs split into two outcomes from step 0."""

import csv

import pytest


TIMING = ("timing/", "tokens_per_s", "self_check/seconds")  # wall-clock measurements differ by nature


def logged_values(root) -> list[dict[str, str]]:
    with open(root / "logs/version_0/metrics.csv") as f:  # the shared run's later resume tests add version_1
        return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in csv.DictReader(f)]


@pytest.mark.slow
def test_two_runs_of_the_same_config_log_identical_values(quickstart_cli_run, quickstart_cli_rerun):
    """The shared 6-step quickstart run against a second run of the same config (its own directory, run at the
    same time)."""
    (first_root, first_config, _), (second_root, second_config, _) = quickstart_cli_run, quickstart_cli_rerun
    assert first_root != second_root
    first_text, second_text = first_config.read_text(), second_config.read_text()
    assert first_text.replace(str(first_root), "ROOT") == second_text.replace(str(second_root), "ROOT")  # the same config
    first, second = logged_values(first_root), logged_values(second_root)
    assert len(first) >= 6 and {"loss", "grad_norm", "reward", "sampler_logprob_diff"} <= set(first[0])
    for step, (a, b) in enumerate(zip(first, second)):
        assert a == b, f"row {step} differs: {sorted((k, a[k], b.get(k)) for k in a if a[k] != b.get(k))}"
