"""``python -m verl.trainer.main_ppo`` end to end with arctic-rl as verl's actor and rollout: two GRPO steps.

What ran, precisely: verl 0.9.1's own CLI in a subprocess (Hydra, ``TaskRunner`` -> ``RayPPOTrainer.init_workers``
and ``fit``: Ray worker group, dataloader over a parquet file, agent loop, reward loop with a
``custom_reward_function.path`` file, GRPO advantages, ``_compute_old_log_prob``, ``_update_actor``, the
``naive`` checkpoint engine's ``update_weights``, the file logger), with docs/verl.md's overrides:
the actor is ``ArcticRLEngine``, the rollout is ``ArcticRLReplica`` (its server samples with the actor
worker's ``ArcticRLClient``). Stand-ins, named: this machine has no GPU, so Ray is started with a logical GPU
(``ray_kwargs.ray_init.num_gpus=1``, verl's own config key: its placement groups always ask for one GPU per
worker) and verl's workers load the test-only ``cpu_test`` platform (``verl_cpu_platform``) through verl's
``VERL_USE_EXTERNAL_MODULES``/``VERL_PLATFORM`` hooks. ``trainer.use_v1=false``: verl's default v1 trainer
needs the ``transfer_queue`` package, which verl 0.9.1 does not install.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from arctic_rl.tasks.toy import echo_score, make_rows

from test_verl_backend import G, PROMPTS, arctic_overrides

STEPS, LR = 2, 0.003
REWARD_FILE = '''from arctic_rl.tasks.toy import echo_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return echo_score(solution_str, ground_truth)
'''


def write_toy_data(root: Path, prompts: int = PROMPTS) -> None:
    """The toy task as verl reads it: ``train.parquet``/``val.parquet`` (verl's chat format, ``2 * prompts`` rows
    each) and ``reward.py`` (a ``custom_reward_function.path`` file) under ``root``."""
    import pandas as pd

    for split, seed in (("train", 0), ("val", 1)):
        rows = [{"data_source": "toy_echo", "prompt": [{"role": "user", "content": r["prompt"]}],
                 "reward_model": {"style": "rule", "ground_truth": r["answer"]}, "extra_info": {"index": i}}
                for i, r in enumerate(make_rows(2 * prompts, seed=seed))]
        pd.DataFrame(rows).to_parquet(root / f"{split}.parquet")
    (root / "reward.py").write_text(REWARD_FILE)


# the CPU stand-ins of every main_ppo run here (no GPU on this machine)
CPU_RAY = [
    "trainer.device=cpu",
    "+ray_kwargs.ray_init.num_gpus=1",  # a logical GPU: verl's placement groups ask for one per worker
    "+ray_kwargs.ray_init.num_cpus=4",  # logical too: the worker bundle asks for 3 CPUs, the TaskRunner 1
    "+ray_kwargs.ray_init.include_dashboard=false",
]


def write_inputs(root: Path, model_dir: Path) -> list[str]:
    """The parquet data (verl's chat format), the reward file and the client config; returns the overrides."""
    write_toy_data(root)
    return arctic_overrides(model_dir, root, lr=LR) + [
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # one hybrid worker = one replica
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"data.train_files={root / 'train.parquet'}", f"data.val_files={root / 'val.parquet'}",
        f"data.train_batch_size={PROMPTS}", "data.max_prompt_length=32", "data.max_response_length=8",
        "data.dataloader_num_workers=0",
        f"reward.custom_reward_function.path={root / 'reward.py'}", "reward.num_workers=1",
        "trainer.use_v1=false", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.logger=[console,file]", f"trainer.rollout_data_dir={root / 'generations'}",
    ] + CPU_RAY


def run_main_ppo(root: Path, overrides: list[str], timeout: float = 400) -> SimpleNamespace:
    """``python -m verl.trainer.main_ppo *overrides`` in ``root`` with the test-only CPU platform in every worker;
    returns its file logger's ``metrics``/``steps`` (``trainer.logger`` must include ``file``) and its output."""
    here = str(Path(__file__).parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.environ.get("PYTHONPATH", ""), here]).strip(os.pathsep),
               VERL_PLATFORM="cpu_test", VERL_USE_EXTERNAL_MODULES="verl_cpu_platform",
               VERL_FILE_LOGGER_PATH=str(root / "metrics.jsonl"), RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1")
    process = subprocess.Popen([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], cwd=root, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = process.communicate(timeout=timeout)
    finally:
        try:  # Ray's actor processes of this run (its own session); the run's ray.init ends with its process
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert process.returncode == 0, log[-6000:]
    metrics = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    return SimpleNamespace(root=root, log=log, metrics=[m["data"] for m in metrics], steps=[m["step"] for m in metrics])


@pytest.fixture(scope="module")
def main_ppo(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("verl-main-ppo")
    run = run_main_ppo(root, write_inputs(root, tiny_model_dir))
    run.generations = [[json.loads(line) for line in (root / "generations" / f"{step}.jsonl").read_text().splitlines()]
                       for step in range(1, STEPS + 1)]
    run.model_dir = tiny_model_dir
    return run


def test_two_steps_logged_with_arctic_rl_metrics(main_ppo):
    """Both steps ran through verl's ``_update_actor``: verl's loss/lr/grad-norm keys and arctic-rl's loss
    metrics, finite, with the values fixed by the config (lr, sequences) and verl's own token count."""
    assert main_ppo.steps == [1, 2]
    for data in main_ppo.metrics:
        assert math.isfinite(data["actor/loss"]) and data["actor/loss"] == data["actor/pg_loss"]
        assert math.isfinite(data["actor/grad_norm"]) and data["actor/grad_norm"] >= 0
        assert data["actor/lr"] == pytest.approx(LR)  # verl's optim.lr, arctic-rl's constant schedule
        assert data["actor/num_sequences"] == PROMPTS * G
        # arctic-rl's token count (its loss normaliser) equals verl's response lengths
        assert data["actor/num_tokens"] == pytest.approx(data["response_length/mean"] * PROMPTS * G)
        assert data["actor/clip_ratio/region_mean"] == 0.0  # on-policy: one mini-batch, ratio 1, nothing clipped


def test_rollouts_are_the_actors_policy_at_each_step(main_ppo):
    """verl's own check: the replica's sampler log-probs equal the actor's ``old_log_probs`` (step 2: after
    ``update_weights``, so the rollout server sampled from the trained weights)."""
    for data in main_ppo.metrics:
        assert data["training/rollout_probs_diff_max"] < 1e-5
        assert data["actor/sampler_logprob_diff"] < 1e-5


def test_rewards_come_from_the_custom_reward_file(main_ppo):
    """verl's generations dump (``trainer.rollout_data_dir``): every sample's score is the reward file's
    ``echo_score`` of its decoded response, and ``critic/score/mean`` is their mean."""
    for data, rows in zip(main_ppo.metrics, main_ppo.generations):
        assert len(rows) == PROMPTS * G
        for row in rows:
            assert row["score"] == pytest.approx(echo_score(row["output"], row["gts"]))
        assert data["critic/score/mean"] == pytest.approx(sum(r["score"] for r in rows) / len(rows))


def unchanged_weights(model_dir: Path, root: Path) -> list[str]:
    """The tensors verl's last ``update_weights`` streamed (``get_per_tensor_param``: arctic-rl's export under
    ``root / "arctic"``, the client's ``server.root_dir``) that still equal the initial model's."""
    import torch
    from safetensors.torch import load_file

    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    trained = {}
    for file in sorted((root / "arctic" / "verl-weights").glob("*.safetensors")):
        trained.update(load_file(file))
    assert trained and set(trained) <= set(initial)
    return [name for name, value in trained.items() if torch.equal(value, initial[name])]


def test_weights_changed(main_ppo):
    """The weights verl's ``update_weights`` streamed after step 2 differ from the initial model in every tensor."""
    assert unchanged_weights(main_ppo.model_dir, main_ppo.root) == []


def test_agent_loop_sampling_params_map_or_are_refused_by_name():
    """The agent loop's ``sampling_params`` as ``ArcticRLClient.sample`` arguments (``max_tokens`` capped at
    ``rollout.response_length``); what the arctic-rl sampler cannot honour is refused, not ignored."""
    from arctic_rl.integrations.verl_mapping import UnsupportedVerlSetting
    from arctic_rl.integrations.verl_replica import sampling_arguments

    params = {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    assert sampling_arguments(params, 8) == {"max_tokens": 8, "temperature": 1.0, "top_p": 0.9}
    assert sampling_arguments({**params, "max_tokens": 5}, 8)["max_tokens"] == 5
    for change, match in (({"temperature": 0}, "greedy"), ({"top_k": 20}, "top_k=20"),
                          ({"repetition_penalty": 1.1}, "repetition_penalty")):
        with pytest.raises(UnsupportedVerlSetting, match=match):
            sampling_arguments({**params, **change}, 8)
