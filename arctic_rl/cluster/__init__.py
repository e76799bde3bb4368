"""Ray: training workers launched with Ray Train (``launch.py``). The rollout-engine actors and their pool sit
below, in ``rollout/engines/ray/actor.py`` and ``rollout/engines/ray/pool.py``, so the rollout callback imports nothing above it."""
