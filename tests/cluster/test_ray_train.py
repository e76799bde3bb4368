"""``arctic-rl fit`` with a ``ray`` section on a real 2-node Ray cluster on this machine (``ray.cluster_utils.Cluster``,
two CPUs per node): 2 Ray Train workers placed ``SPREAD`` (one per Ray node; ArcticStrategy ZeRO-2 over gloo) sharing 2 vLLM engine replicas, against a
single-process run (its own in-process engine) on the same global batch: the same rewards and gradient norms at each
step and the same weights after 3 steps. One pair of runs covers the Ray engines too: synced over gloo after every
step, they hold the trainer's weights, and per-request seeds make a prompt's samples independent of the engine serving
it (the in-process trainer with a Ray engine actor runs in tests/rollout/test_overlap.py)."""

import csv
import json

import pytest
import torch
import yaml

from arctic_rl.cli import main
from tests.helpers import quickstart_config, write_config
from tests.ray_nodes import local_ray_nodes

pytestmark = pytest.mark.slow
REWARD_TOL = 1e-5  # ZeRO-2 over 2 ranks vs 1 process: weights agree to ~1e-7, so samples and rewards match
WEIGHT_TOL = 1e-5  # the reduction order differs (2 ranks' gradients summed by DeepSpeed vs one backward)

# a callback beside the configs (their directory is on sys.path, the Ray Train workers' too): every rank takes part in
# the export, rank 0 writes it
FINAL_POLICY = '''
import json
import os

import lightning.pytorch as pl


class SaveFinalPolicy(pl.Callback):
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        pl_module.save_policy(self.directory if trainer.is_global_zero else None)
        if os.environ.get("ARCTIC_RL_RAY_TRAIN_WORKER") == "1":  # where Ray put this worker, as Lightning sees it
            import ray

            place = {"num_nodes": trainer.num_nodes, "devices": len(trainer.device_ids), "node": ray.get_runtime_context().get_node_id()}
            with open(f"{self.directory}-rank{trainer.global_rank}.json", "w") as f:
                json.dump(place, f)
'''


def logged(root, key: str = "reward") -> list[float]:
    rows = list(csv.DictReader(open(next(root.glob("logs/version_*/metrics.csv")))))
    return [float(r[key]) for r in rows if r.get(key)]


def final_weights(directory) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()


@pytest.fixture
def two_nodes():
    """Two Ray nodes of two CPUs each; the run joins them through ``ray.address`` (this process does not)."""
    with local_ray_nodes(head_cpus=2, node_cpus=[2], connect=False) as nodes:
        yield nodes


@pytest.mark.timeout(3600)  # a Ray cluster, 2 Ray Train workers and 2 engine actors: 139 s on the 2-core CI machine
def test_two_ray_train_workers_on_two_nodes_match_one_process(toy_task, tmp_path, two_nodes):
    import ray

    steps = 3
    (tmp_path / "final_policy.py").write_text(FINAL_POLICY)
    base = {"trainer.max_steps": steps, "model.init_args.sampling.group_size": 4}
    single = quickstart_config(toy_task, tmp_path / "single", **base, **{"data.init_args.batch_size": 8})
    single["trainer"]["callbacks"].append({"class_path": "final_policy.SaveFinalPolicy", "init_args": {"directory": str(tmp_path / "single/final")}})
    main(["fit", "--config", str(write_config(single, tmp_path / "single.yaml"))])

    config = quickstart_config(toy_task, tmp_path / "ray", **base, **{"data.init_args.batch_size": 4})  # x 2 workers
    config["ray"] = {"address": two_nodes.address, "num_workers": 2, "cpus_per_worker": 0.5, "placement_strategy": "SPREAD",
                     "storage_path": str(tmp_path / "ray_results")}
    config["trainer"]["strategy"] = {"class_path": "arctic_rl.strategies.ArcticStrategy", "init_args": {"stage": 2}}
    config["trainer"]["callbacks"][0]["init_args"]["ray"] = {"num_engines": 2, "num_cpus_per_engine": 0.5, "timeout_s": 300}
    config["trainer"]["callbacks"].append({"class_path": "final_policy.SaveFinalPolicy", "init_args": {"directory": str(tmp_path / "ray/final")}})
    main(["fit", "--config", str(write_config(config, tmp_path / "ray.yaml"))])
    assert not ray.is_initialized()
    places = [json.loads((tmp_path / f"ray/final-rank{rank}.json").read_text()) for rank in range(2)]
    assert places[0]["node"] != places[1]["node"], places  # SPREAD: one worker on each Ray node
    # Ray Train groups workers into Lightning nodes by IP, and both Ray nodes of this machine share one: num_nodes 1 x
    # devices 2 here; on a real cluster (an IP per node) the same run is num_nodes 2 x devices 1
    assert [p["num_nodes"] * p["devices"] for p in places] == [2, 2], places

    assert len(logged(tmp_path / "single")) == steps
    assert logged(tmp_path / "ray") == pytest.approx(logged(tmp_path / "single"), abs=REWARD_TOL)
    # the gradient norm is global (DeepSpeed reduces over both workers before clipping)
    assert logged(tmp_path / "ray", "grad_norm") == pytest.approx(logged(tmp_path / "single", "grad_norm"), rel=1e-4)
    single_weights, ray_weights = final_weights(tmp_path / "single/final"), final_weights(tmp_path / "ray/final")
    assert single_weights.keys() == ray_weights.keys()
    worst = max((single_weights[k] - ray_weights[k]).abs().max().item() for k in single_weights)
    assert worst < WEIGHT_TOL, worst
    # the engine actors hold the trainer's weights after each sync: their log-probs are the trainer's
    diffs = logged(tmp_path / "ray", "sampler_logprob_diff")
    assert len(diffs) == steps and max(diffs) < 1e-4
    assert yaml.safe_load((tmp_path / "ray.yaml").read_text())["ray"]["num_workers"] == 2
