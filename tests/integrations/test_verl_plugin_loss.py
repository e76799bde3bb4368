"""verl's ``policy_loss.loss_mode`` naming a plugin loss (``integrations/verl_mapping.py``: pure, no verl import):
with the test plugin package installed, ``loss_mode: scaled_pg`` runs the plugin with verl's clip/KL/entropy
settings under ``fit``'s names plus its own keys (``actor_rollout_ref.actor.arctic_rl.loss_config``); every other
name, and every setting that would be dropped, is refused naming its key. ``integration_tests/verl`` runs the same
mapping with verl's own ``ActorConfig`` and engine."""

from __future__ import annotations

import pytest
import torch

from arctic_rl.integrations.verl_mapping import UnsupportedVerlSetting, loss_settings
from arctic_rl.loss_registry import compute_loss
from arctic_rl.modules.losses import LossInputs, LossNormalizer
from tests.helpers import REPO
from tests.plugin_package import installed_plugin


class VerlActorSection:
    """A stand-in for verl 0.9.1's ``ActorConfig`` (not ours): the fields ``loss_settings`` reads, at verl's
    defaults, with ``get`` as verl's ``BaseConfig`` has it."""

    def __init__(self, loss_mode: str = "vanilla", **changes):
        self.policy_loss = {"loss_mode": loss_mode}
        self.loss_agg_mode, self.entropy_coeff, self.loss_scale_factor = "token-mean", 0.0, None
        self.use_kl_loss, self.kl_loss_type, self.kl_loss_coef = False, "low_var_kl", 0.001
        self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c = 0.2, 0.2, 3.0
        self.use_prefix_grouper = False
        vars(self).update(changes)

    def get(self, key: str, default=None):
        return vars(self).get(key, default)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The distribution ``arl_test_plugin_pg`` installed (``tests/plugin_package.py``); yields its marker file."""
    yield from installed_plugin(tmp_path, monkeypatch, REPO)


def test_vanilla_is_unchanged(plugin):
    assert loss_settings(VerlActorSection()) == ("dapo", {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0})
    assert loss_settings(VerlActorSection(loss_agg_mode="seq-mean-token-mean"))[0] == "grpo"
    assert not plugin.exists()


def test_a_plugin_loss_mode_runs_the_plugin_with_verls_settings_and_its_own_keys(plugin):
    section = VerlActorSection("scaled_pg", use_kl_loss=True, kl_loss_type="k3", kl_loss_coef=0.01, entropy_coeff=0.02)
    name, config = loss_settings(section, {"scale": 2.0})
    assert (name, config) == ("scaled_pg", {
        "clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0, "kl_coef": 0.01, "kl_bias_correction": False,
        "kl_estimator": "low_var_kl", "entropy_coef": 0.02, "entropy_aggregation": "loss", "scale": 2.0})
    # the registry runs it: on-policy its loss is -scale * sum(A * mask) / tokens
    logprobs = -torch.rand(3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    inputs = LossInputs(logprobs, logprobs.detach(), advantages, mask, LossNormalizer.of(mask, 4),
                        ref_logprobs=logprobs.detach(), entropy=torch.ones_like(logprobs))
    loss, stats = compute_loss(name, inputs, config)
    assert loss.item() == pytest.approx(-2.0 * (1.0 * 3 - 0.5 * 2 + 0.25 * 4) / 9, rel=1e-12)
    assert stats["plugin/ratio_mean"].item() == 1.0 and plugin.read_text().splitlines() == ["True"]
    assert loss_settings(VerlActorSection("scaled_pg"))[1] == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0}


@pytest.mark.parametrize("loss_mode, changes, loss_config, message", [
    ("scaled_pgg", {}, None, r"policy_loss.loss_mode='scaled_pgg' .*a registered arctic-rl plugin loss: "
                             r"\[.*'scaled_pg'.*\] \(plugins add more: entry point group 'arctic_rl.losses'\)"),
    ("cispo", {}, None, r"policy_loss.loss_mode='cispo' .*built-in losses are chosen by loss_mode 'vanilla'"),
    ("scaled_pg", {"loss_agg_mode": "seq-mean-token-mean"}, None,
     r"loss_agg_mode='seq-mean-token-mean' .*'scaled_pg' normalises by token_mean \('token-mean'\)"),
    ("scaled_pg", {}, {"clip_low": 0.1}, r"arctic_rl.loss_config.clip_low=0.1 .*verl's own key sets it"),
    ("scaled_pg", {}, ["scale"], r"arctic_rl.loss_config=\['scale'\] .*an object of named values"),
    ("vanilla", {}, {"scale": 2.0}, r"arctic_rl.loss_config=\{'scale': 2.0\} .*configures a plugin loss_mode"),
    ("scaled_pg", {"entropy_coeff": -0.1}, None, r"entropy_coeff=-0.1 "),
], ids=["unknown", "built_in", "agg_mode", "clash", "not_an_object", "vanilla_with_loss_config", "entropy_coeff"])
def test_what_cannot_be_honoured_is_refused_by_name(plugin, loss_mode, changes, loss_config, message):
    with pytest.raises(UnsupportedVerlSetting, match=r"^actor_rollout_ref.actor." + message):
        loss_settings(VerlActorSection(loss_mode, **changes), loss_config)
