"""The training core's one loss registry: the built-ins registered with their normalisers, registration and
look-up errors, a registered loss's needs and the inputs it is refused without, and the names the TRL
adapter accepts."""

from __future__ import annotations

import re

import pytest
import torch

from arctic_rl.errors import ConfigError
from arctic_rl import loss_registry
from arctic_rl.loss_registry import LossInputError, compute_loss, get_loss, loss_needs, register_loss
from arctic_rl.modules.losses import GRPO_FAMILY, LossInputs, LossNormalizer


@pytest.fixture
def isolated(monkeypatch):
    """Registrations made in the test vanish after it."""
    get_loss("dapo")  # the built-ins are registered before the table is copied
    monkeypatch.setattr(loss_registry, "LOSSES", dict(loss_registry.LOSSES))


def inputs(entropy: bool = True) -> LossInputs:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    return LossInputs(logprobs, logprobs.detach(), torch.tensor([1.0, -2.0]), mask, LossNormalizer.of(mask, 3),
                      entropy=torch.ones(2, 3) if entropy else None)


def test_the_builtins_are_registered_with_their_normalisers():
    declared = {name: get_loss(name).aggregation for name in GRPO_FAMILY}
    assert declared == {"grpo": "sequence_mean", "sapo": "sequence_mean", "bnpo": "token_mean", "dapo": "token_mean",
                        "cispo": "token_mean", "vespo": "token_mean", "dr_grpo": "constant", "luspo": "sequence_sum"}
    assert all(get_loss(name).builtin for name in GRPO_FAMILY)
    assert loss_needs("grpo", {"kl_coef": 0.1}) == {"ref_logprobs"} and loss_needs("grpo", {}) == set()


def test_a_registered_loss_gets_what_it_needs(isolated):
    @register_loss("entropy_only", needs=("entropy",), aggregation="token_mean")
    def entropy_only(x: LossInputs, config):
        return -(x.entropy * x.mask).sum() / x.normalizer.num_tokens * config.get("scale", 1.0), {}

    assert get_loss("entropy_only").aggregation == "token_mean" and loss_needs("entropy_only", {}) == {"entropy"}
    assert compute_loss("entropy_only", inputs(), {"scale": 3.0})[0].item() == pytest.approx(-3.0)
    with pytest.raises(LossInputError, match="loss 'entropy_only' needs entropy, which was not computed") as info:
        compute_loss("entropy_only", inputs(entropy=False), {})
    assert info.value.need == "entropy"


def test_lookup_and_registration_errors(isolated):
    with pytest.raises(ConfigError, match=re.escape("unknown loss 'nope'; known: bnpo, cispo, dapo, ")):
        get_loss("nope")
    with pytest.raises(ValueError, match=re.escape("loss 'x': aggregation must be one of token_mean, sequence_mean, "
                                                   "sequence_sum, constant or None, got 'mean'")):
        register_loss("x", aggregation="mean")
    with pytest.raises(ConfigError, match="loss 'dapo': loss config must be an object of named values, got a list"):
        loss_needs("dapo", ["clip_low"])


def test_the_trl_adapter_takes_any_registered_loss(isolated):
    from arctic_rl.integrations.trl_mapping import loss_settings

    register_loss("mine", aggregation="token_mean")(lambda x, config: (x.logprobs.sum(), {}))
    settings = loss_settings("mine", "token", 0.2, 0.28, None, 0.0, True, 8)
    assert settings.aggregation == "token_mean" and settings.options["clip_high"] == 0.28
    with pytest.raises(ValueError, match=re.escape("GRPOConfig.loss_type='ppo': arctic-rl's losses are ['bnpo',")):
        loss_settings("ppo", "token", 0.2, 0.28, None, 0.0, True, 8)
