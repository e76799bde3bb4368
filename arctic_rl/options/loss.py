"""The loss's option sections: ``LossConfig`` (``model.init_args.loss``: the policy objective's constants) and
``Regularizers`` (``model.init_args.regularizers``: KL penalty and entropy bonus), with the names they choose from.

``loss_type`` is a name in the one loss registry (``arctic_rl/loss_registry.py``, plugins loaded); the losses
themselves, as functions over tensors, are ``modules/losses.py`` and ``modules/builtin_losses.py``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Literal, get_args

from arctic_rl.errors import ConfigError  # a ValueError: the service turns it into a RequestError
from arctic_rl.loss_registry import PLUGIN_HINT, LossAggregation, is_loss, loss_names

# k1/k2/k3: Schulman's estimators (TRL's k3 unclamped); abs, low_var_kl (verl's clamped k3) and the "+" variants:
# verl 0.9.1's kl_penalty (verl.trainer.ppo.core_algos), same definitions
KLEstimator = Literal["k1", "k2", "k3", "abs", "low_var_kl", "k1+", "k3+", "abs+", "low_var_kl+"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
EntropyAggregation = Literal["token_mean", "loss"]
ImportanceSamplingLevel = Literal["token", "sequence"]
AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)


@dataclass(frozen=True)
class LossConfig:
    """The policy objective's constants. Defaults are TRL 1.16's."""

    loss_type: str = "dapo"  # a registered loss's name (loss_registry.py; plugins add more)
    importance_sampling_level: ImportanceSamplingLevel = "token"
    clip_low: float = 0.2  # TRL epsilon: ratio >= 1 - clip_low
    clip_high: float = 0.2  # TRL epsilon_high: ratio <= 1 + clip_high (DAPO: 0.28)
    dual_clip: float | None = None  # TRL delta: cap on the ratio, binding for negative advantages
    loss_aggregation: LossAggregation | None = None  # override the loss type's normaliser (None: the one it registered)
    cispo_max_ratio: float = 5.0  # TRL epsilon_high under loss_type cispo (ScaleRL's eps_max)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.loss_type, str) or not is_loss(self.loss_type):  # a registered loss, plugins loaded
            raise ConfigError(f"loss_type must be one of {loss_names()}, got {self.loss_type!r}{PLUGIN_HINT}")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ConfigError(f"importance_sampling_level must be 'token' or 'sequence', got {self.importance_sampling_level!r}")
        if self.loss_aggregation is not None and self.loss_aggregation not in AGGREGATIONS:
            raise ConfigError(f"loss_aggregation must be one of {sorted(AGGREGATIONS)} (or None), got {self.loss_aggregation!r}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        # the pairings the papers use (TRL warns about the same ones)
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            warnings.warn("loss_type='luspo' is defined with importance_sampling_level='sequence'", stacklevel=3)
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            warnings.warn("loss_type='vespo' computes its own sequence weight; use importance_sampling_level='token'", stacklevel=3)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


@dataclass(frozen=True)
class Regularizers:
    """The terms added to the policy objective: a KL penalty to a frozen reference and an entropy bonus."""

    kl_coef: float = 0.0  # TRL's beta; needs ref_logprobs when > 0
    kl_estimator: KLEstimator = "k3"
    kl_bias_correction: bool = True  # multiply the per-token KL by the importance ratio (TRL's default)
    entropy_coef: float = 0.0
    # token_mean: the bonus is a token mean whatever the loss's normaliser (TRL); loss: the loss's own aggregation
    # (verl: agg_loss(entropy, loss_agg_mode))
    entropy_aggregation: EntropyAggregation = "token_mean"

    def __post_init__(self) -> None:
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        if self.entropy_aggregation not in get_args(EntropyAggregation):
            raise ConfigError(f"entropy_aggregation must be 'token_mean' or 'loss', got {self.entropy_aggregation!r}")
