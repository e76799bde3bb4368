"""Training strategies: :class:`ArcticStrategy`, Lightning's DeepSpeed ZeRO 1/2/3 made to run on CPU
(gloo) as well as GPU, with atomic checkpoints, exact resume and a ``save_pretrained`` export."""

from arctic_rl.strategies.arctic import ArcticStrategy

__all__ = ["ArcticStrategy"]
