"""``arctic-rl fit`` with ``trainer.devices: 2`` (Lightning starts the second rank with the first's arguments) and an
in-process transformers engine in each rank, started from the files rank 0 wrote: with the rollout stream it
trains what one process with the whole batch trains (the same rewards, gradient norms and, combined over the ranks,
per-sequence metrics each step),
since every prompt's samples depend on its slot in the global batch, not on the rank or engine that drew them.
And the settings this path cannot run are refused before anything starts."""

from __future__ import annotations

import csv

import pytest

from tests.helpers import quickstart_config, run_cli

STEPS = 4


def logged(root) -> list[dict[str, float]]:
    (path,) = root.glob("logs/version_*/metrics.csv")
    with open(path) as f:
        return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f) if r.get("reward")]


def stream_config(toy_task, root, devices: int) -> dict:
    config = quickstart_config(toy_task, root, **{"trainer.max_steps": STEPS, "trainer.devices": devices, "trainer.enable_progress_bar": False,
                                                  "data.init_args.batch_size": 8 // devices, "model.init_args.sampling.group_size": 4,
                                                  "model.init_args.optim.warmup_steps": 0})
    if devices > 1:
        config["trainer"]["strategy"] = {"class_path": "arctic_rl.strategies.ArcticStrategy", "init_args": {"stage": 2}}
    config["trainer"]["callbacks"] = [{"class_path": "arctic_rl.RolloutCallback", "init_args": {
        "engine": "transformers", "max_staleness": 2, "partial_rollout_tokens": 3, "rounds_per_step": 1, "log_samples_every_n_steps": 0}}]
    return config


@pytest.mark.slow
def test_two_ranks_with_an_engine_each_train_what_one_process_does(toy_task, tmp_path):
    runs = {}
    for devices in (1, 2):
        done = run_cli(stream_config(toy_task, tmp_path / f"d{devices}", devices), tmp_path / f"d{devices}.yaml", timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        runs[devices] = logged(tmp_path / f"d{devices}")
    one, two = runs[1], runs[2]
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(STEPS))
    for a, b in zip(one, two):
        assert b["reward"] == pytest.approx(a["reward"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)  # global: DeepSpeed reduces it over the ranks
        # the other metrics are combined over the ranks (step_metrics.over_ranks): per-sequence means and maxima equal
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)  # the ranks' shares summed
        for key in ("response_length/mean", "response_length/max", "rollout/staleness", "stream/partial_sample_frac"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
    assert max(r["rollout/staleness"] for r in two) >= 1 and max(r["stream/partial_token_frac"] for r in two) > 0.5


@pytest.mark.parametrize("engine,ray,num_nodes,match", [
    ("vllm", None, 1, "joins the ranks' process group at start and waits forever; use engine: transformers"),
    ("transformers", None, 2, "2 machines need the engines as Ray actors"),
])
def test_in_process_engines_the_ranks_cannot_run_are_refused_first(engine, ray, num_nodes, match):
    from arctic_rl.errors import ConfigError
    from arctic_rl.rollout.engines.host import EngineHost

    host = EngineHost(engine, ray=ray)
    host.check_ranks(1, 1)  # one rank: anything goes
    with pytest.raises(ConfigError, match=match):
        host.check_ranks(4, num_nodes)


def test_a_resolved_config_is_taken_as_it_is_by_the_ranks_started_with_it(tmp_path):
    """The first process replaces ``--config FILE`` by the file's resolved YAML; Lightning starts the other ranks with
    those arguments, and they must neither re-read it as a path nor lose the config's directory on ``sys.path``."""
    from arctic_rl.cli import check_config_files
    from arctic_rl.cluster.launch import ray_section
    from arctic_rl.config_paths import config_dirs, resolve_config_args

    (tmp_path / "run.yaml").write_text("data:\n  init_args:\n    train_path: ./train.jsonl\nray:\n  num_workers: 0\n")
    argv = resolve_config_args(["fit", "--config", str(tmp_path / "run.yaml")])
    assert str(tmp_path / "train.jsonl") in argv[2]
    check_config_files(argv)  # no "No such file" for the YAML
    assert resolve_config_args(argv) == argv and config_dirs(argv) == [str(tmp_path)]
    assert ray_section(argv).num_workers == 0
