"""Rollout engines in Ray actors: one engine per actor, and a pool of replicas used like one engine."""
