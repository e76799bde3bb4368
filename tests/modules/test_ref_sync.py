"""TRL's ``sync_ref_model`` pieces: the mixing formula on plain modules and the config errors. Trained
through the real module in ``test_rollout_options.py``; under real ZeRO-2/3 in ``tests/strategies``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.modules.options import RefSyncOptions
from arctic_rl.modules.ref_sync import RefModelSync, init_reference, mix_parameters, ref_sync_callbacks


def test_mix_is_alpha_policy_plus_one_minus_alpha_reference():
    policy, ref = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with torch.no_grad():
        policy.weight.copy_(torch.tensor([[1.0, 2.0]])), policy.bias.fill_(4.0)
        ref.weight.copy_(torch.tensor([[3.0, -2.0]])), ref.bias.fill_(0.0)
    mix_parameters(policy, ref, 0.25)
    torch.testing.assert_close(ref.weight, torch.tensor([[0.25 * 1 + 0.75 * 3, 0.25 * 2 - 0.75 * 2]]))
    torch.testing.assert_close(ref.bias, torch.tensor([1.0]))
    init_reference(policy, ref)
    assert torch.equal(ref.weight, policy.weight) and not any(p.requires_grad for p in ref.parameters()) and not ref.training


def test_sync_settings_are_checked_and_give_the_callback():
    hp = dict(sync_ref_model=True, ref_model_mixup_alpha=0.6, ref_model_sync_steps=512, kl_coef=0.1)
    [callback] = ref_sync_callbacks(SimpleNamespace(**hp))
    assert isinstance(callback, RefModelSync) and (callback.alpha, callback.every) == (0.6, 512)
    assert ref_sync_callbacks(SimpleNamespace(**{**hp, "sync_ref_model": False})) == []
    for change, message in (({"ref_model_mixup_alpha": 1.5}, r"^model.ref_sync.ref_model_mixup_alpha must be in \[0, 1\], got 1.5$"),
                            ({"ref_model_sync_steps": 0}, "^model.ref_sync.ref_model_sync_steps must be >= 1, got 0$")):
        with pytest.raises(ConfigError, match=message):
            RefSyncOptions(**{"sync_ref_model": True, **change})
    assert RefSyncOptions(sync_ref_model=False, ref_model_sync_steps=0).ref_model_sync_steps == 0  # off: not read, not checked
