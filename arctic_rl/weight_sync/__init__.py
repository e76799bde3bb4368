"""Pushing trainer weights into rollout engines."""

from arctic_rl.weight_sync.base import SyncReport, WeightSync
from arctic_rl.weight_sync.in_process import InProcessWeightSync

__all__ = ["InProcessWeightSync", "SyncReport", "WeightSync"]
