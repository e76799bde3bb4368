"""verl's reference worker and its per-step learning rate, in one process against a real arctic-rl core.

What ran (verl 0.9.1 code unless named): ``ActorRolloutRefWorker(role="actor")`` and ``ActorRolloutRefWorker(
role="ref")``, both building ``ArcticRLEngine`` through ``EngineRegistry`` (the ref one from verl's forward-only
``actor_rollout_ref.ref`` section, ``strategy`` inherited from the actor); three GRPO steps of ``fit``'s order:
``ArcticRLRollout`` rollouts and GRPO advantages (``test_verl_backend.rollout_with_advantages``),
``RayPPOTrainer._compute_old_log_prob``, ``_compute_ref_log_prob`` (the ref worker's engine asks the actor's
service for ``ref_logprobs``), ``_update_actor`` with ``use_kl_loss`` (``low_var_kl``) and two mini-batches per
step under a cosine schedule. The stand-in trainer and the one-rank process group are ``test_verl_backend``'s.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from arctic_rl.integrations import verl_replica
from arctic_rl.integrations.verl import ArcticRLRollout

from test_verl_backend import PROMPTS, reference_logprobs, rollout_with_advantages, verl_config
from test_verl_loss_options import verl_scheduler

STEPS, MINI_BATCHES = 3, 2
SETTINGS = (
    "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.kl_loss_coef=0.1",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",  # verl requires it of the ref without dynamic bsz
    f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS // MINI_BATCHES}",
    "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
    "actor_rollout_ref.actor.optim.min_lr_ratio=0.1", f"actor_rollout_ref.actor.optim.total_training_steps={STEPS}",
)


@pytest.fixture(scope="module")
def ref_steps(tiny_model_dir, one_rank_group, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import ActorRolloutRefWorker

    config = verl_config(tiny_model_dir, tmp_path_factory.mktemp("arctic-ref"), SETTINGS)
    actor = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
    actor.init_model()
    ref = ActorRolloutRefWorker(config.actor_rollout_ref, role="ref")
    ref.init_model()
    client = actor.actor.engine.client
    lrs = []  # the learning rate of every arctic-rl optimizer step (its optim_step's report)
    optim_step = client.optim_step

    def recording_optim_step(**kwargs):
        stepped = optim_step(**kwargs)
        lrs.append(stepped["lr"])
        return stepped

    client.optim_step = recording_optim_step
    rollout = ArcticRLRollout(omega_conf_to_dataclass(config.actor_rollout_ref.rollout),
                              omega_conf_to_dataclass(config.actor_rollout_ref.model), client=client)
    trainer = SimpleNamespace(config=config, actor_rollout_wg=actor, ref_policy_wg=ref, ref_in_actor=False,
                              distillation_config=None)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    steps = []
    for step in range(STEPS):
        batch = rollout_with_advantages(rollout, step)
        batch = batch.union(RayPPOTrainer._compute_old_log_prob(trainer, batch)[0])
        batch = batch.union(RayPPOTrainer._compute_ref_log_prob(trainer, batch))
        before = len(lrs)
        metrics = RayPPOTrainer._update_actor(trainer, batch).meta_info["metrics"]
        asyncio.run(rollout.update_weights())
        steps.append(SimpleNamespace(batch=batch, metrics=metrics, lrs=lrs[before:],
                                     initial_logprobs=reference_logprobs(initial, batch)))
    yield SimpleNamespace(steps=steps, config=config, ref=ref)
    client.close()
    verl_replica.unregister_worker_client(client)


def test_ref_worker_runs_the_arctic_rl_engine_as_reference(ref_steps):
    assert type(ref_steps.ref.ref.engine).__name__ == "ArcticRLEngine" and ref_steps.ref.ref.engine.is_reference


def test_ref_log_probs_are_the_initial_policys(ref_steps):
    """verl's ``ref_log_prob`` (the ref worker -> ``ArcticRLEngine`` -> the service's ``ref_logprobs``) equals
    ``log_softmax(model(ids).logits)`` of the initial weights at every step; after the first update they differ
    from the actor's ``old_log_probs`` (so they are not the current policy's)."""
    for i, step in enumerate(ref_steps.steps):
        mask = step.batch.batch["response_mask"].bool()
        ref, old = step.batch.batch["ref_log_prob"][mask], step.batch.batch["old_log_probs"][mask]
        torch.testing.assert_close(ref, step.initial_logprobs[mask], atol=1e-5, rtol=0)
        if i == 0:
            torch.testing.assert_close(ref, old, atol=1e-5, rtol=0)
        else:
            assert (ref - old).abs().max() > 1e-3


def test_kl_term_is_computed_from_the_reference(ref_steps):
    """arctic-rl's KL metric (``low_var_kl`` against verl's ``ref_log_prob``, a token mean over the mini-batches):
    zero at the first mini-batch of step 1 only, so positive from the second mini-batch on."""
    for step in ref_steps.steps:
        kl = step.metrics["actor/kl"]
        kl = np.mean(kl) if isinstance(kl, list) else kl
        assert np.isfinite(kl) and kl > 0


def test_lr_advances_once_per_verl_step_over_its_mini_batches(ref_steps):
    """Two mini-batches per verl step (two arctic-rl optimizer steps) under verl's cosine schedule: both use the
    step's learning rate, equal to verl's scheduler (built as its FSDP engine builds it) at that step; the logged
    ``actor/lr`` is the next step's, as verl's FSDP engine reports it."""
    from verl.utils.config import omega_conf_to_dataclass

    optim = omega_conf_to_dataclass(ref_steps.config.actor_rollout_ref.actor.optim)
    scheduler, expected = verl_scheduler(optim, STEPS), []
    for _ in range(STEPS + 1):
        expected.append(scheduler.get_last_lr()[0])
        scheduler.step()
    assert len(set(expected[:STEPS])) == STEPS  # a schedule that moves every step
    for k, step in enumerate(ref_steps.steps):
        assert step.lrs == pytest.approx([expected[k]] * MINI_BATCHES, rel=1e-9)
        logged = step.metrics["actor/lr"]
        assert (logged[-1] if isinstance(logged, list) else logged) == pytest.approx(expected[k + 1], rel=1e-9)
