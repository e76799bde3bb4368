"""arctic-rl: GRPO post-training for LLMs, Lightning-style.

    from arctic_rl import GRPOModule

    class MyTask(GRPOModule):
        def reward(self, prompts, completions, answer, **columns):
            return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""

from importlib import import_module
from typing import TYPE_CHECKING

from arctic_rl._version import __version__  # noqa: F401  (arctic_rl.__version__)

_EXPORTS = {
    "GRPOModule": "arctic_rl.modules.grpo",
    "PromptDataModule": "arctic_rl.data.prompts",
    "RolloutCallback": "arctic_rl.rollout.callback",
    "RolloutBatch": "arctic_rl.rollout.batch",
    "RunSummary": "arctic_rl.callbacks.summary",
    "ArcticRLClient": "arctic_rl.serve.client",
    "ArcticRLClientConfig": "arctic_rl.serve.config",
    "TrainBatch": "arctic_rl.serve.batch",
}

if TYPE_CHECKING:
    from arctic_rl.callbacks.summary import RunSummary
    from arctic_rl.data.prompts import PromptDataModule
    from arctic_rl.modules.grpo import GRPOModule
    from arctic_rl.rollout.batch import RolloutBatch
    from arctic_rl.rollout.callback import RolloutCallback
    from arctic_rl.serve.batch import TrainBatch
    from arctic_rl.serve.client import ArcticRLClient
    from arctic_rl.serve.config import ArcticRLClientConfig


def __getattr__(name: str):
    """Import heavy modules on first use, so ``import arctic_rl`` (and the CLI's --help) stay fast."""
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'arctic_rl' has no attribute {name!r}")


__all__ = list(_EXPORTS)
