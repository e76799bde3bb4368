"""``arctic-rl fit`` against TRL 1.16's own ``GRPOTrainer``, the reference for learning (BENCHMARKS.md "CPU
quickstart"; ``benchmarks/learning_vs_trl.py`` runs the same comparison over many seeds):

- the same rollouts give the same weights: the quickstart's first steps (real vLLM rollouts, warm-up,
  clipping, AdamW) are recorded, fed to TRL's trainer in place of its own generation, and TRL's weights
  after each of its optimizer steps equal ours;
- the same task learns as fast: the quickstart's shape (G=8 x 16 prompts, lr 3e-3 with 5 warm-up steps,
  dapo) from the same initial weights, data and reward, on three seeds, reaches TRL's reward level.
"""

from __future__ import annotations

import contextlib
import io
import json

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from arctic_rl.cli import build_cli  # noqa: E402
from arctic_rl.tasks.toy import echo_score, write_tiny_model  # noqa: E402
from tests.helpers import quickstart_config, write_config  # noqa: E402

pytestmark = pytest.mark.slow

LR, WARMUP, GROUP, PROMPTS, REPLAY_STEPS = 3e-3, 5, 8, 16, 7


class RecordRollouts(pl.Callback):
    """Per step: the rollout the step trained on, its reward and the policy's parameters after it."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rollout = batch["rollout"]
        self.steps.append({"prompt_token_ids": [list(p) for p in rollout.prompt_token_ids],
                           "response_ids": rollout.response_ids.clone(), "response_mask": rollout.response_mask.clone(),
                           "advantages": rollout.advantages.clone(), "reward": float(rollout.rewards.mean())})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[-1]["params"] = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}


def fit(toy_task, root, model_dir, seed: int, steps: int, checkpoints: bool = False):
    """The quickstart config (vLLM rollouts) from ``model_dir``'s weights for ``steps`` steps, in this process;
    the recorded steps and the trainer's last metrics."""
    config = quickstart_config(toy_task, root, **{"trainer.max_steps": steps, "trainer.enable_progress_bar": False,
                                                  "seed_everything": seed, "model.init_args.sampling.seed": seed,
                                                  "model.init_args.model": str(model_dir), "data.init_args.seed": seed})
    if not checkpoints:
        config["trainer"]["callbacks"] = [c for c in config["trainer"]["callbacks"] if not c["class_path"].endswith("ModelCheckpoint")]
    root.mkdir(parents=True, exist_ok=True)
    cli = build_cli(["--config", str(write_config(config, root / "c.yaml"))], run=False)
    recorder = RecordRollouts()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return recorder.steps, cli.trainer.callback_metrics


def trl_args(out_dir, seed: int, steps: int) -> GRPOConfig:
    """TRL's settings for the quickstart's: one optimizer step per 16 prompts x 8 completions."""
    return GRPOConfig(output_dir=str(out_dir), per_device_train_batch_size=GROUP * PROMPTS, num_generations=GROUP,
                      max_completion_length=8, max_steps=steps, learning_rate=LR, warmup_steps=WARMUP,
                      lr_scheduler_type="constant_with_warmup", loss_type="dapo", epsilon=0.2, beta=0.0, temperature=1.0,
                      max_grad_norm=1.0, seed=seed, data_seed=seed, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                      save_strategy="no", disable_tqdm=True)


def rows_of(toy_task) -> list[dict]:
    return [json.loads(line) for line in (toy_task / "train.jsonl").read_text().splitlines()]


class ReplayGRPOTrainer(GRPOTrainer):
    """TRL's trainer whose generation batch is arctic-rl's recorded rollout of the same step (its own loss,
    optimizer, scheduler, clipping and accumulation then train on it)."""

    def __init__(self, *args, recorded: list[dict], pad_token_id: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recorded, self.pad = recorded, pad_token_id

    def _generate_and_score_completions(self, inputs):
        step = self.recorded[self.state.global_step]
        width = max(map(len, step["prompt_token_ids"]))
        prompt_ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in step["prompt_token_ids"]])
        prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in step["prompt_token_ids"]])
        completion_mask = step["response_mask"].long()
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": step["response_ids"],
                "completion_mask": completion_mask, "advantages": step["advantages"].float(),
                "num_items_in_batch": completion_mask.sum()}


LEARN_SEEDS, LEARN_STEPS = (0, 1, 2), 100


@pytest.fixture(scope="module")
def seed0_run(toy_task, tmp_path_factory):
    """The learning test's seed-0 run (``LEARN_STEPS`` steps, with checkpoints), shared with the replay test,
    which reads its first ``REPLAY_STEPS`` steps: the schedule is constant after warm-up and every sample has its
    own seed, so they are the steps a ``REPLAY_STEPS``-step run takes. ``(model_dir, root, recorded steps, last
    metrics, the summary lines it printed)``."""
    root = tmp_path_factory.mktemp("seed0")
    model_dir = write_tiny_model(root / "model0", seed=0)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        steps, metrics = fit(toy_task, root / "fit0", model_dir, 0, LEARN_STEPS, checkpoints=True)
    summary = [line for line in printed.getvalue().splitlines() if line.startswith("arctic-rl: ")]
    return model_dir, root, steps, metrics, summary


@pytest.mark.timeout(3600)  # its setup is seed0_run, a 100-step run: 144 s on the 2-core machine at load 10
def test_trls_trainer_on_our_rollouts_ends_each_step_with_our_weights(toy_task, tmp_path, seed0_run):
    model_dir, _, steps, _, _ = seed0_run
    recorded = steps[:REPLAY_STEPS]
    assert len(recorded) == REPLAY_STEPS
    gaps: list[dict[str, float]] = []

    class CompareWeights(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            ours = recorded[state.global_step - 1]["params"]
            gaps.append({n: (p.detach() - ours[n]).abs().max().item() for n, p in model.named_parameters()})

    trainer = ReplayGRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                args=trl_args(tmp_path / "trl", 0, REPLAY_STEPS), train_dataset=Dataset.from_list(rows_of(toy_task)),
                                recorded=recorded, pad_token_id=0, callbacks=[CompareWeights()])
    trainer.train()
    assert len(gaps) == REPLAY_STEPS
    for step, by_name in enumerate(gaps):
        worst = max(by_name, key=by_name.get)
        # every step moves weights by up to lr (AdamW): a schedule or update that differs shows as >= 1e-4
        assert by_name[worst] < 2e-5, f"step {step}: TRL's {worst} differs from ours by {by_name[worst]:.2e}"
    moved = max((recorded[-1]["params"][n] - p).abs().max().item() for n, p in recorded[0]["params"].items())
    assert moved > 1e-3  # the steps compared really trained


def trl_rewards(toy_task, model_dir, out_dir, seed: int, steps: int) -> list[float]:
    rewards: list[float] = []

    def echo_reward(prompts, completions, answer, **columns):
        scores = [echo_score(c, a) for c, a in zip(completions, answer)]
        rewards.append(sum(scores) / len(scores))
        return scores

    GRPOTrainer(model=str(model_dir), reward_funcs=echo_reward, args=trl_args(out_dir, seed, steps),
                train_dataset=Dataset.from_list(rows_of(toy_task))).train()
    return rewards


@pytest.mark.timeout(3600)  # 100-step runs, five here and one in seed0_run: 152 s for all six in CI, over 1800 s at load 10
def test_the_quickstart_learns_as_trls_trainer_does(toy_task, tmp_path, seed0_run):
    """Three seeds each side: the mean over seeds of the last-10-step reward after 100 steps. TRL's level
    here is measured in the same run; over 40 seeds on another machine the 10-step mean at step 100 was
    0.82 for TRL and 0.81 for arctic-rl (BENCHMARKS "Learning against TRL"), the seed-to-seed spread much
    larger than the gap. The first run also checks what a user sees: the summary line, the engine's and
    the self-check's agreement with the trainer, the last checkpoint."""
    ours, theirs = [], []
    for seed in LEARN_SEEDS:
        if seed == 0:  # run once for both tests of this file (the fixture)
            model_dir, root, steps, metrics, summary = seed0_run
        else:
            model_dir = write_tiny_model(tmp_path / f"model{seed}", seed=seed)
            steps, metrics = fit(toy_task, tmp_path / f"fit{seed}", model_dir, seed, LEARN_STEPS)
        ours.append([s["reward"] for s in steps])
        if seed == 0:
            first, last = sum(ours[0][:10]) / 10, sum(ours[0][-10:]) / 10
            assert len(summary) == 1 and f"reward {first:.3f} -> {last:.3f}" in summary[0] and f"{LEARN_STEPS} steps" in summary[0]
            assert float(metrics["sampler_logprob_diff"]) < 1e-4  # the engine samples from the trainer's weights
            assert abs(float(metrics["sampling/nll_minus_entropy"])) < 0.5  # ... and from its distribution
            assert float(metrics["self_check/max_gap/zorro_auto"]) < 1e-5 and float(metrics["self_check/max_gap/naive"]) < 1e-5
            assert (root / "fit0" / "checkpoints" / "last.ckpt").exists()
        theirs.append(trl_rewards(toy_task, model_dir, tmp_path / f"trl{seed}", seed, LEARN_STEPS))
    first = [sum(r[:10]) / 10 for r in ours + theirs]
    assert max(first) < 0.1  # both start at a random policy's score (~0.04)
    ours_last = sum(sum(r[-10:]) / 10 for r in ours) / len(ours)
    trl_last = sum(sum(r[-10:]) / 10 for r in theirs) / len(theirs)
    assert trl_last > 0.5, f"TRL's own level on this machine: {trl_last:.3f}"
    assert ours_last > trl_last - 0.15, f"arctic-rl {ours_last:.3f} against TRL {trl_last:.3f} (mean last-10 reward over seeds {LEARN_SEEDS})"
