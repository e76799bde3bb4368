"""verl 0.9.1's loss options and LR schedules against verl's own functions: ``use_kl_loss`` (every ``kl_loss_type``),
``entropy_coeff`` and the optimizer's warmup / cosine, as the arctic_rl strategy maps them.

- KL: arctic-rl's ``kl_penalty`` under the mapped estimator equals verl's ``core_algos.kl_penalty`` in value and
  gradient (float64, log ratios inside and outside verl's clamps).
- Loss: the service's built-in loss under ``verl_mapping.loss_settings`` (policy + KL + entropy) equals verl's
  ``ppo_loss`` composition (``compute_policy_loss_vanilla`` + ``kl_loss_coef * agg_loss(kl_penalty)`` -
  ``entropy_coeff * agg_loss(entropy)``) in value and in its gradients with respect to the log-probs and entropies.
- Schedule: ``lr_factor`` under ``verl_mapping.schedule_settings`` equals verl's scheduler (built as its FSDP
  engine builds it) at every step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from arctic_rl.integrations.verl_mapping import KL_TYPE_TO_ESTIMATOR, loss_settings, schedule_settings
from arctic_rl.modules.losses import LossNormalizer, kl_penalty
from arctic_rl.modules.lr_schedule import lr_factor
from arctic_rl.serve import registry

N, T = 6, 7


def verl_kl_types() -> list[str]:
    return sorted(KL_TYPE_TO_ESTIMATOR)


def log_probs(seed: int, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(N, T, generator=gen, dtype=torch.float64) * 3 * scale
    ref = -torch.rand(N, T, generator=gen, dtype=torch.float64) * 3 * scale
    return logprobs, ref


@pytest.mark.parametrize("kl_type", verl_kl_types())
@pytest.mark.parametrize("scale", [1.0, 15.0])  # 15: log ratios beyond low_var_kl's clamps (|log r| > 20, kl > 10)
def test_kl_estimators_equal_verls_kl_penalty(kl_type, scale):
    from verl.trainer.ppo.core_algos import kl_penalty as verl_kl_penalty

    logprobs, ref = log_probs(1, scale)
    ours_in, verl_in = logprobs.clone().requires_grad_(True), logprobs.clone().requires_grad_(True)
    ours, theirs = kl_penalty(ours_in, ref, KL_TYPE_TO_ESTIMATOR[kl_type]), verl_kl_penalty(verl_in, ref, kl_type)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    weights = torch.rand(N, T, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    torch.testing.assert_close(ours_in.grad, verl_in.grad, rtol=1e-12, atol=1e-12)
    if scale > 1 and kl_type in ("low_var_kl", "k3"):
        assert (theirs == 10).any()  # the clamp was exercised


@pytest.fixture(scope="module")
def actor_config(tmp_path_factory):
    """verl's actor section as a user's config makes it (``ArcticRLActorConfig`` over verl's defaults)."""
    from verl.utils.config import omega_conf_to_dataclass

    from test_verl_backend import verl_config

    root = tmp_path_factory.mktemp("loss-options")
    return omega_conf_to_dataclass(verl_config(root / "no-model", root).actor_rollout_ref.actor)


def verl_loss(config, logprobs, old, advantages, ref, entropy, mask):
    """verl's ``ppo_loss`` after its inputs are padded (``verl.workers.utils.losses``, the same calls)."""
    from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn
    from verl.trainer.ppo.core_algos import kl_penalty as verl_kl_penalty

    config.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=N, loss_scale_factor=None)
    response_mask = mask.bool()
    loss, _ = get_policy_loss_fn("vanilla")(old_log_prob=old, log_prob=logprobs, advantages=advantages,
                                            response_mask=response_mask, loss_agg_mode=config.loss_agg_mode,
                                            config=config, rollout_is_weights=None)
    loss = loss - config.entropy_coeff * agg_loss(entropy, response_mask, config.loss_agg_mode, **config.global_batch_info)
    kld = verl_kl_penalty(logprob=logprobs, ref_logprob=ref, kl_penalty=config.kl_loss_type)
    return loss + config.kl_loss_coef * agg_loss(kld, response_mask, config.loss_agg_mode, **config.global_batch_info)


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("kl_type", ["low_var_kl", "k1", "abs", "mse", "k3+", "low_var_kl+"])
def test_loss_with_kl_and_entropy_equals_verls_ppo_loss(actor_config, agg_mode, kl_type):
    config = replace(actor_config, loss_agg_mode=agg_mode, use_kl_loss=True, kl_loss_type=kl_type, kl_loss_coef=0.3,
                     entropy_coeff=0.02, clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=3.0)
    logprobs, ref = log_probs(3)
    gen = torch.Generator().manual_seed(4)
    old = logprobs + 0.2 * torch.randn(N, T, generator=gen, dtype=torch.float64)  # ratios on both sides of the clip
    mask = torch.ones(N, T, dtype=torch.float64)
    for i, length in enumerate([7, 5, 3, 7, 1, 6]):
        mask[i, length:] = 0
    sequence_advantages = torch.randn(N, generator=gen, dtype=torch.float64)
    entropy = torch.rand(N, T, generator=gen, dtype=torch.float64) * 2

    lp_verl, ent_verl = logprobs.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    expected = verl_loss(config, lp_verl, old, sequence_advantages[:, None] * mask, ref, ent_verl, mask)
    expected.backward()

    name, loss_config = loss_settings(config)
    lp, ent = logprobs.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    inputs = registry.LossInputs(logprobs=lp, old_logprobs=old, advantages=sequence_advantages, mask=mask,
                                 normalizer=LossNormalizer.of(mask, T), ref_logprobs=ref, entropy=ent)
    got, stats = registry.compute_loss(name, inputs, loss_config)
    got.backward()
    # verl's seq-mean-token-mean divides by (tokens + 1e-8): relative differences of 1e-9
    torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(lp.grad, lp_verl.grad, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(ent.grad, ent_verl.grad, rtol=1e-8, atol=1e-12)
    assert lp.grad.abs().sum() > 0 and "kl" in stats


def verl_scheduler(optim, total: int):
    """verl's scheduler as its FSDP engine builds it (``FSDPEngine._build_lr_scheduler``)."""
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    warmup = optim.lr_warmup_steps
    if warmup <= 0:
        warmup = int(optim.lr_warmup_steps_ratio * total)
    if optim.lr_scheduler_type == "constant":
        return get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=warmup)
    return get_cosine_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=warmup, num_training_steps=total,
                                           min_lr_ratio=optim.min_lr_ratio, num_cycles=optim.num_cycles)


@pytest.mark.parametrize("settings", [
    {"lr_scheduler_type": "constant", "lr_warmup_steps": 3},
    {"lr_scheduler_type": "constant", "lr_warmup_steps_ratio": 0.25},
    {"lr_scheduler_type": "cosine", "lr_warmup_steps_ratio": 0.1},
    {"lr_scheduler_type": "cosine", "lr_warmup_steps": 2, "min_lr_ratio": 0.1},
    {"lr_scheduler_type": "cosine", "lr_warmup_steps": 0, "min_lr_ratio": 0.05, "num_cycles": 1.5},
])
def test_lr_schedule_equals_verls_scheduler(settings):
    from verl.workers.config import FSDPOptimizerConfig

    total = 20
    optim = FSDPOptimizerConfig(lr=3e-4, total_training_steps=total, **settings)
    mapped = schedule_settings(optim)
    scheduler, lrs = verl_scheduler(optim, total), []
    for _ in range(total):
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.step()
    ours = [optim.lr * lr_factor(step, mapped["warmup_steps"], mapped.get("total_steps", 0), mapped["lr_schedule"],
                                 mapped.get("min_lr_ratio", 0.0), mapped.get("num_cycles", 0.5)) for step in range(total)]
    assert ours == pytest.approx(lrs, rel=1e-12, abs=1e-18)
    assert len(set(lrs)) > 2  # a schedule that moves
