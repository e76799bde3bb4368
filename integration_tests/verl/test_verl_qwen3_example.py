"""verl's own Qwen3 GRPO example (``examples/grpo_trainer/run_qwen3_8b_fsdp.sh``) with arctic-rl as actor, reference
and rollout: ``python -m verl.trainer.main_ppo`` with the script's overrides (``run_qwen3_8b_fsdp.overrides``, kept
verbatim) after docs/verl.md's diff, read from the doc itself, on the tiny Qwen3 on CPU for 2 steps.

What the script brings that the other main_ppo test does not: ``use_kl_loss`` (``low_var_kl``, coefficient 0.001),
so verl's ref worker runs ``ArcticRLEngine`` as its reference engine and ``_compute_ref_log_prob`` asks the actor's
service for ``ref_logprobs``; four mini-batches per verl step (1024 / 256, scaled to 4 / 1) under verl's default
constant schedule; ``use_dynamic_bsz``; ``balance_batch``; validation (before training and at the last step) and a
checkpoint at the last step. The stand-ins and why each line changed: docs/verl.md, "verl's Qwen3 GRPO example".
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest

from test_verl_backend import write_client_config
from test_verl_main_ppo import run_main_ppo, unchanged_weights, write_toy_data

HERE = Path(__file__).parent
STEPS, PROMPTS, N, MINI_BATCHES = 2, 4, 5, 4


def script_overrides() -> list[str]:
    """The example's overrides as the script passes them (comments dropped)."""
    lines = (HERE / "run_qwen3_8b_fsdp.overrides").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#")]


def doc_diff() -> tuple[list[str], list[str]]:
    """docs/verl.md's diff: (removed lines, added lines), as written there."""
    doc = (HERE.parents[1] / "docs" / "verl.md").read_text()
    block = doc.split("<!-- verl-qwen3-example-diff -->", 1)[1].split("```", 2)[1]
    lines = block.splitlines()[1:]  # after the "diff" info string
    assert all(line[:1] in "+-" for line in lines if line), "the diff has only added and removed lines"
    return [line[1:] for line in lines if line.startswith("-")], [line[1:] for line in lines if line.startswith("+")]


def example_overrides(data: Path, model_dir: Path) -> list[str]:
    """The script's overrides with the doc's diff applied: every removed line is the script's, verbatim."""
    removed, added = doc_diff()
    overrides = script_overrides()
    missing = [line for line in removed if line not in overrides]
    assert missing == [], f"the diff removes lines the script does not have: {missing}"
    kept = [line for line in overrides if line not in removed]
    expanded = [line.replace("$(date +%Y%m%d_%H%M)", time.strftime("%Y%m%d_%H%M")) for line in kept + added]
    return [line.replace("$DATA", str(data)).replace("$TINY_QWEN3", str(model_dir)) for line in expanded]


def test_the_diff_changes_only_what_docs_name():
    """The diff's lines touch only the backend, toy-scale, validation-temperature, logger and CPU keys docs/verl.md
    explains; the script's loss, KL, entropy, learning-rate and rollout.n settings are left as they are."""
    removed, added = doc_diff()
    keys = {re.sub(r"^\+*", "", line).split("=", 1)[0] for line in removed + added}
    for kept in ("actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.kl_loss_type",
                 "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.entropy_coeff",
                 "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.rollout.n", "algorithm.adv_estimator"):
        assert kept not in keys
    assert "actor_rollout_ref.actor.use_kl_loss=True" in script_overrides()


@pytest.fixture(scope="module")
def example_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("verl-qwen3-example")
    write_toy_data(root, PROMPTS)
    write_client_config(root)
    run = run_main_ppo(root, example_overrides(root, tiny_model_dir))
    run.train = [(step, data) for step, data in zip(run.steps, run.metrics) if "actor/loss" in data]
    run.model_dir = tiny_model_dir
    return run


def test_example_runs_two_steps_with_its_mini_batches_and_schedule(example_run):
    """Both steps trained through verl's ``update_actor``: finite loss and gradient norm, the script's constant
    ``lr=1e-6``, and verl's four mini-batches of 5 sequences each (``rollout.n`` kept)."""
    assert [step for step, _ in example_run.train] == [1, 2]
    for _, data in example_run.train:
        assert math.isfinite(data["actor/loss"]) and math.isfinite(data["actor/grad_norm"])
        assert data["actor/lr"] == pytest.approx(1e-6)
        assert data["actor/num_sequences"] == N  # per optimizer step: a mini-batch of 1 prompt x 5 samples
        # verl averages the per-mini-batch token counts: all of the step's response tokens over four mini-batches
        assert data["actor/num_tokens"] == pytest.approx(data["response_length/mean"] * PROMPTS * N / MINI_BATCHES)
        assert data["training/rollout_probs_diff_max"] < 1e-5  # the replica samples the actor's policy


def test_reference_log_probs_come_from_verls_ref_worker(example_run):
    """verl's ref step ran on the arctic_rl engine at every step (its timer), and the KL term arctic-rl computed
    from verl's ``ref_log_prob`` is finite, non-negative and tiny: at the script's lr 1e-6 the policy stays within
    float32 rounding of the reference (runs logged 0.0 and ~1e-8), so the reference log-probs are the policy's, not
    zeros (KL ~ 1 or more). That they are the initial policy's after real updates: test_verl_ref_and_schedule.py."""
    for _, data in example_run.train:
        assert data["timing_s/ref"] > 0
        assert math.isfinite(data["actor/kl"]) and 0 <= data["actor/kl"] < 1e-4


def test_validation_sampled_through_arctic_rl(example_run):
    """The script's validation (before training, and at the last step) ran through the arctic_rl replica."""
    validations = [data for data in example_run.metrics if any(key.startswith("val-core/") for key in data)]
    assert len(validations) == 2


def test_example_changed_every_weight(example_run):
    """Eight optimizer steps at 1e-6 moved every tensor verl streamed to its rollout after the last step."""
    assert unchanged_weights(example_run.model_dir, example_run.root) == []


def test_last_step_checkpoint_is_arctic_rls_state(example_run):
    """The script's ``save_freq=20`` saves at the last step: verl's trainer state beside arctic-rl's ``save_state``
    of the actor (under the client's ``server.root_dir``, at verl's relative path)."""
    (verl_dir,) = (example_run.root / "checkpoints" / "verl_grpo_gsm8k_math").iterdir()
    actor = example_run.root / "arctic" / verl_dir.relative_to(example_run.root) / f"global_step_{STEPS}" / "actor"
    assert (verl_dir / f"global_step_{STEPS}" / "data.pt").is_file() and (actor / "state.ckpt").is_file()
