"""A GRPO run whose rollouts come from 2 vLLM engine actors on a local Ray cluster, synced over gloo
after every step, reproduces the in-process single-engine run."""

import pytest

from tests.helpers import quickstart_config
from tests.modules.test_grpo import run_fit

pytestmark = pytest.mark.slow


def test_ray_engines_match_the_in_process_engine(toy_task, tmp_path):
    import ray

    changes = {"trainer.max_steps": 4, "data.init_args.batch_size": 8, "model.init_args.group_size": 4}
    _, local = run_fit(quickstart_config(toy_task, tmp_path / "local", **changes), tmp_path / "local.yaml")

    config = quickstart_config(toy_task, tmp_path / "ray", **changes)
    config["trainer"]["callbacks"][0]["init_args"]["ray"] = {"num_engines": 2, "timeout_s": 120}
    cli, remote = run_fit(config, tmp_path / "ray.yaml")
    assert not ray.is_initialized()  # the callback shut down the cluster it started
    metrics = cli.trainer.callback_metrics
    assert float(metrics["sampler_logprob_diff"]) < 1e-4  # engines hold the trainer's weights after each sync
    for step in range(4):
        assert remote.steps[step]["prompts"] == local.steps[step]["prompts"]
        # per-request seeds make sampling independent of which engine serves a prompt
        assert remote.steps[step]["reward"] == pytest.approx(local.steps[step]["reward"], abs=1e-6)
