"""Adapters that let other RL frameworks drive arctic-rl, each in the framework's own vocabulary.

- ``arctic_rl.integrations.trl``: ``ArcticGRPOTrainer``, TRL's ``GRPOTrainer`` with ZoRRo log-probs and
  arctic-rl's loss family (``pip install -e ".[trl]"``).
- ``arctic_rl.integrations.skyrl``: ``ArcticBackend``, a SkyRL Tinker-engine backend; ``python -m
  arctic_rl.integrations.skyrl serve`` runs SkyRL's Tinker API server on it (``scripts/integrations/skyrl.sh``).
- ``arctic_rl.integrations.verl``: ``ArcticRLEngine`` (verl's ``EngineRegistry`` strategy ``arctic_rl``) and
  ``ArcticRLRollout``, selected from a verl 0.9.1 config (``scripts/integrations/verl.sh``).

Nothing is imported here, so ``import arctic_rl.integrations`` never needs a framework installed.
"""
