"""``GRPOModule``'s option sections under their former import path: the dataclasses live in the leaf package
:mod:`arctic_rl.options` (``options/sections.py`` and its siblings), once."""

from arctic_rl.options import (LR_SCHEDULES, SECTIONS, ZORRO_DEDUP, AttentionBackend, ComputeOptions, CorrectionConfig,
                               LoraOptions, LossConfig, ModuleOptions, OptimOptions, RefSyncOptions, Regularizers,
                               RolloutOptions, SamplingOptions, ZorroDedup)

__all__ = ["LR_SCHEDULES", "SECTIONS", "ZORRO_DEDUP", "AttentionBackend", "ComputeOptions", "CorrectionConfig", "LoraOptions",
           "LossConfig", "ModuleOptions", "OptimOptions", "RefSyncOptions", "Regularizers", "RolloutOptions",
           "SamplingOptions", "ZorroDedup"]
