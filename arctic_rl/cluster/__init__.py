"""Ray: training workers launched with Ray Train (``launch.py``). The rollout-engine actors and their pool sit
below, in ``rollout/engine_actor.py`` and ``rollout/engine_pool.py``, so the rollout callback imports nothing above it."""
