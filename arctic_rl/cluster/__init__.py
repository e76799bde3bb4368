"""Ray: rollout-engine actors and their pool (training workers via Ray Train come later)."""
