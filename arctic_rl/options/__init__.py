"""Every option dataclass of arctic-rl, plain data checked in ``__post_init__``: ``GRPOModule``'s sections and what they
compose, and :class:`ModuleOptions`, the tree of them. A leaf under the rollout and the training core: it imports only
``arctic_rl.errors`` and the loss registry's name table (``loss.loss_type`` is a registered name), and no torch.

Modules: ``sections.py`` (``sampling``, ``optim``, ``compute``, ``ref_sync``; :data:`SECTIONS`, :class:`ModuleOptions`),
``rollout.py`` (``rollout``: overlong buffer, dynamic sampling, multi-turn environment), ``loss.py`` (``loss``,
``regularizers``), ``corrections.py`` and ``lora.py``.
"""

from arctic_rl.options.corrections import SAMPLER_CORRECTION_MODES, CorrectionConfig, SamplerCorrectionMode
from arctic_rl.options.lora import LoraOptions
from arctic_rl.options.loss import (AGGREGATIONS, KL_ESTIMATORS, EntropyAggregation, ImportanceSamplingLevel, KLEstimator,
                                    LossConfig, Regularizers)
from arctic_rl.options.rollout import (AdvantageEstimator, AgentOptions, DynamicSampling, EnvironmentOptions, OverlongBuffer,
                                       RewardAggregation, RewardScaling, RolloutOptions)
from arctic_rl.options.sections import (LR_SCHEDULES, SECTIONS, ZORRO_DEDUP, AttentionBackend, ComputeOptions,
                                        GradientCheckpointing, LigerSetting, ModuleOptions, OptimOptions, RefSyncOptions,
                                        SamplingOptions, ZorroDedup)

__all__ = [
    "AGGREGATIONS", "KL_ESTIMATORS", "LR_SCHEDULES", "SAMPLER_CORRECTION_MODES", "SECTIONS", "ZORRO_DEDUP",
    "AdvantageEstimator", "AttentionBackend", "ComputeOptions", "CorrectionConfig", "DynamicSampling", "EntropyAggregation",
    "AgentOptions", "EnvironmentOptions", "GradientCheckpointing", "ImportanceSamplingLevel", "KLEstimator", "LigerSetting", "LoraOptions",
    "LossConfig", "ModuleOptions", "OptimOptions", "OverlongBuffer", "RefSyncOptions", "Regularizers", "RewardAggregation",
    "RewardScaling", "RolloutOptions", "SamplerCorrectionMode", "SamplingOptions", "ZorroDedup",
]
