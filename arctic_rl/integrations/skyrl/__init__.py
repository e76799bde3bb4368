"""arctic-rl as a SkyRL training backend: SkyRL's Tinker API server and engine, driven by the ``tinker``
SDK, train and sample through ``ArcticRLClient`` (``python -m arctic_rl.integrations.skyrl serve``).

- ``backend.py``: ``ArcticBackend``, SkyRL's ``AbstractBackend`` over the client (Tinker datums become arctic-rl
  batches through ``serve/tinker/batch.py``; Tinker's losses are the registered ``tinker.*``, ``serve/tinker/losses.py``).
- ``loss_choice.py``: which registered loss a request's ``loss_fn`` runs (Tinker's, or a plugin's; pure functions).
- ``compat.py``: the patches SkyRL 0.4.0 needs (Python 3.11 import, backend registration, engine command).
- ``launch.py``: the ``serve`` / ``engine`` entry points.

Nothing is imported here, so importing the package never needs SkyRL installed.
"""
