"""The callbacks every GRPO run gets: the end-of-run summary, atomic checkpoints, mid-epoch stop
positions that resume exactly, SIGTERM handling and a resumed optimizer that follows the config."""

from __future__ import annotations

import lightning.pytorch as pl


def safety_net_callbacks() -> list[pl.Callback]:
    from arctic_rl.callbacks.atomic_checkpoints import AtomicCheckpoints
    from arctic_rl.callbacks.preemption import StopOnSigterm
    from arctic_rl.callbacks.resume_state import MidEpochStop
    from arctic_rl.callbacks.summary import RunSummary
    from arctic_rl.callbacks.optimizer_follows_config import OptimizerFollowsConfig

    return [RunSummary(), MidEpochStop(), AtomicCheckpoints(), StopOnSigterm(), OptimizerFollowsConfig()]
