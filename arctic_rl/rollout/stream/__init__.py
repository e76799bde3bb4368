"""The rollout stream: asynchronous rollouts with partial samples under a staleness bound (``stream.py``)."""
