"""Adapters that let other RL frameworks drive arctic-rl, each in the framework's own vocabulary.

- ``arctic_rl.integrations.trl``: ``ArcticGRPOTrainer``, TRL's ``GRPOTrainer`` with ZoRRo log-probs and
  arctic-rl's loss family (``pip install -e ".[trl]"``).

Nothing is imported here, so ``import arctic_rl.integrations`` never needs a framework installed.
"""
