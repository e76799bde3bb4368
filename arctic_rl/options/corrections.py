"""The ``corrections`` option section (``model.init_args.corrections``): TRL 1.16's loss-side corrections by their
names, the rollout/trainer mismatch correction, off-policy sequence masking and masking of truncated completions
(the functions over tensors are ``modules/corrections.py``), and MoE router replay (``router_replay.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from arctic_rl.errors import ConfigError

SamplerCorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
SAMPLER_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class CorrectionConfig:
    """The loss-side options of ``GRPOModule`` (TRL ``GRPOConfig`` names; defaults are TRL's except the
    correction's switch, off here because it costs a no-grad forward pass per rollout batch)."""

    vllm_importance_sampling_correction: bool = False
    vllm_importance_sampling_mode: SamplerCorrectionMode = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None  # C_min (None: no lower bound)
    vllm_importance_sampling_clip_max: float | None = 3.0  # C_max (None: no upper bound)
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0  # rho: train the policy term on the top rho of tokens by entropy
    off_policy_mask_threshold: float | None = None  # delta of DeepSeek-V3.2's off-policy sequence masking
    # MoE router replay (R3): the engine records each token's experts, the trainer's forward (and recompute) routes to them
    router_replay: bool = False

    def __post_init__(self) -> None:
        if self.vllm_importance_sampling_mode not in SAMPLER_CORRECTION_MODES:
            raise ConfigError(f"model.vllm_importance_sampling_mode must be one of {', '.join(SAMPLER_CORRECTION_MODES)},"
                              f" got {self.vllm_importance_sampling_mode!r}")
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if (lo is not None and lo < 0) or (hi is not None and hi <= 0) or (lo is not None and hi is not None and lo > hi):
            raise ConfigError(f"model.vllm_importance_sampling_clip_min/clip_max must satisfy 0 <= clip_min <= clip_max"
                              f" and clip_max > 0, got {lo} / {hi}")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ConfigError(f"model.top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold > 0:
            raise ConfigError(f"model.off_policy_mask_threshold must be > 0 (or null), got {self.off_policy_mask_threshold}")
