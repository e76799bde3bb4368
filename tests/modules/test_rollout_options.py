"""The rollout-side algorithm options trained through the real module (CLI config, vLLM engine):
named rewards with None and weights, DAPO's dynamic sampling (refilled to a full batch, bounded,
logged, resumed exactly), DAPO's soft overlong penalty, TRL's ``normalize_then_sum`` and TRL's
reference-model sync (``sync_ref_model``: the mixing formula at TRL's step times, and its resume)."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch

from arctic_rl.cli import build_cli
from arctic_rl.tasks.toy import EchoDigitGRPO, echo_score
from tests.helpers import quickstart_config, write_config

pytestmark = pytest.mark.slow
ALPHA = 0.5


class OddDigitRewards(EchoDigitGRPO):
    """Two named rewards, both constant on even-digit prompts, whose groups therefore carry no signal:
    ``echo`` (0 there) and ``length`` (None there: it does not apply)."""

    def reward(self, prompts, completions, answer, **columns):
        odd = [int(a) % 2 == 1 for a in answer]
        return {"echo": [echo_score(c, a) if o else 0.0 for c, a, o in zip(completions, answer, odd)],
                "length": [len(c.split()) / 8 if o else None for c, o in zip(completions, odd)]}


class Record(pl.Callback):
    """Per rollout batch: its prompts, rollout metrics, named rewards and response lengths; the policy
    after every optimizer step (``policy[k]``: after k steps) and the reference model at the end."""

    def __init__(self) -> None:
        self.steps, self.policy, self.ref = {}, {}, None

    def _snapshot(self, trainer, pl_module) -> None:
        self.policy.setdefault(trainer.global_step, [p.detach().clone() for p in pl_module.model.parameters()])

    def on_train_start(self, trainer, pl_module):
        self._snapshot(trainer, pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._snapshot(trainer, pl_module)  # runs before the module's own callbacks (RefModelSync)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._snapshot(trainer, pl_module)
        rollout = batch["rollout"]
        self.steps[trainer.global_step] = {
            "prompts": rollout.prompts[:: rollout.group_size], "metrics": dict(batch["rollout_metrics"]),
            "loss": float(trainer.callback_metrics["loss"]), "rewards": rollout.rewards.tolist(),
            "components": {k: v.clone() for k, v in rollout.reward_components.items()},
            "lengths": rollout.response_mask.sum(-1).tolist()}

    def on_train_end(self, trainer, pl_module):
        self.ref = [p.detach().clone() for p in pl_module.ref_model.parameters()] if pl_module.ref_model is not None else None


def run_fit(config: dict, path, ckpt_path: str | None = None):
    cli = build_cli(["--config", str(write_config(config, path))], run=False)
    record = Record()
    cli.trainer.callbacks.append(record)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return cli, record


def options_config(toy_task, root):
    """G=4, 8 prompts, 2 optimizer steps per rollout batch, a checkpoint every rollout batch."""
    config = quickstart_config(toy_task, root, **{
        "model.class_path": "tests.modules.test_rollout_options.OddDigitRewards", "model.init_args.sampling.group_size": 4,
        "data.init_args.batch_size": 8, "trainer.max_steps": 4, "model.init_args.optim.mini_batches": 2,
        "model.init_args.rollout.reward_weights": {"echo": 1.0, "length": 0.5},
        "model.init_args.rollout.dynamic_sampling": {"max_num_gen_batches": 4},
        "model.init_args.regularizers.kl_coef": 0.05, "model.init_args.ref_sync.sync_ref_model": True,
        "model.init_args.ref_sync.ref_model_sync_steps": 1, "model.init_args.ref_sync.ref_model_mixup_alpha": ALPHA})
    config["trainer"]["callbacks"][0]["init_args"]["log_samples_every_n_steps"] = 1
    config["trainer"]["callbacks"][1]["init_args"]["every_n_train_steps"] = 2
    return config


@pytest.fixture(scope="module")
def options_runs(toy_task, tmp_path_factory):
    """A 4-step run (2 rollout batches) and the same run resumed from its step-2 checkpoint."""
    root = tmp_path_factory.mktemp("options")
    full = run_fit(options_config(toy_task, root / "full"), root / "full.yaml")
    ckpt = root / "full" / "checkpoints" / "epoch=0-step=2.ckpt"
    resumed = run_fit(options_config(toy_task, root / "resumed"), root / "resumed.yaml", ckpt_path=str(ckpt))
    return root, full, resumed


def test_dynamic_sampling_trains_on_full_batches_of_informative_groups(options_runs):
    root, (cli, rec), _ = options_runs
    assert cli.trainer.global_step == 4 and sorted(rec.steps) == [2, 4]
    for step, row in rec.steps.items():
        m = row["metrics"]
        assert len(row["prompts"]) == 8, step  # the full batch
        assert all(int(p.split()[-2]) % 2 == 1 for p in row["prompts"]), (step, row["prompts"])  # even digits: dropped
        assert m["reward/zero_std_group_frac"] == 0 and m["dynamic_sampling/padded_groups"] == 0
        assert 2 <= m["dynamic_sampling/rounds"] <= 4 and m["dynamic_sampling/dropped_groups"] >= 1
    assert torch.isfinite(torch.tensor(rec.steps[4]["loss"]))


def test_named_rewards_are_weighted_logged_and_in_the_samples_table(options_runs):
    root, (cli, rec), _ = options_runs
    row = rec.steps[4]
    echo, length = row["components"]["echo"], row["components"]["length"]
    torch.testing.assert_close(torch.tensor(row["rewards"]), echo + 0.5 * length)  # odd prompts only: both apply
    assert row["metrics"]["rewards/length/mean"] == pytest.approx(length.double().mean().item(), rel=1e-6)
    assert {"rewards/echo/mean", "rewards/echo/std", "rewards/length/std"} <= set(cli.trainer.callback_metrics)
    lines = [json.loads(line) for line in (root / "full" / "logs" / "version_0" / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 16 and {"step", "prompt", "completion", "reward", "echo", "length"} == set(lines[0])


def test_reference_model_is_mixed_after_every_sync_step_as_in_trl(options_runs):
    """``ref_model_sync_steps=1`` with 2 optimizer steps per rollout batch: TRL mixes after every optimizer
    step, ``ref = alpha * policy + (1 - alpha) * ref``, starting from the initial policy."""
    _, (cli, rec), _ = options_runs
    assert sorted(rec.policy) == [0, 1, 2, 3, 4]
    expected = rec.policy[0]
    for step in (1, 2, 3, 4):
        expected = [ALPHA * p + (1 - ALPHA) * r for p, r in zip(rec.policy[step], expected)]
    for got, want, first, last in zip(rec.ref, expected, rec.policy[0], rec.policy[4]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert any(not torch.allclose(r, p) for r, p in zip(rec.ref, rec.policy[4]))


def test_resume_reproduces_rounds_prompts_rewards_and_the_mixed_reference(options_runs):
    _, (_, full), (cli, resumed) = options_runs
    assert sorted(resumed.steps) == [4] and cli.trainer.global_step == 4
    a, b = full.steps[4], resumed.steps[4]
    assert b["prompts"] == a["prompts"]
    assert b["rewards"] == pytest.approx(a["rewards"], abs=1e-6)
    for key in ("dynamic_sampling/rounds", "dynamic_sampling/dropped_groups"):
        assert b["metrics"][key] == a["metrics"][key]
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
    for got, want in zip(resumed.ref, full.ref):  # the checkpoint kept the reference mixed at steps 1 and 2
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_overlong_penalty_normalize_then_sum_and_the_round_cap_train(toy_task, tmp_path):
    """``max_num_gen_batches: 1``: no second round; every dropped group pads the batch back, logged."""
    changes = {"model.init_args.sampling.group_size": 4, "data.init_args.batch_size": 8, "trainer.max_steps": 2,
               "model.init_args.rollout.overlong_buffer": {"len": 4, "penalty_factor": 1.0},
               "model.init_args.rollout.multi_objective_aggregation": "normalize_then_sum",
               "model.init_args.rollout.dynamic_sampling": {"max_num_gen_batches": 1}}
    cli, rec = run_fit(quickstart_config(toy_task, tmp_path, **changes), tmp_path / "c.yaml")
    assert cli.trainer.global_step == 2
    for step, row in rec.steps.items():
        m, lengths = row["metrics"], torch.tensor(row["lengths"], dtype=torch.float64)
        assert m["dynamic_sampling/rounds"] == 1 and m["dynamic_sampling/padded_groups"] == m["dynamic_sampling/dropped_groups"]
        expected = -((lengths - (8 - 4)).clamp(min=0) / 4)  # max_response_length 8, buffer 4 tokens
        torch.testing.assert_close(row["components"]["overlong_penalty"].double(), expected, atol=1e-6, rtol=0)
        assert m["rewards/overlong_penalty/mean"] == pytest.approx(expected.mean().item(), abs=1e-6)
        assert torch.isfinite(torch.tensor(row["loss"]))
