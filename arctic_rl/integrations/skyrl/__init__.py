"""arctic-rl as a SkyRL training backend: SkyRL's Tinker API server and engine, driven by the ``tinker``
SDK, train and sample through ``ArcticRLClient`` (``python -m arctic_rl.integrations.skyrl serve``).

- ``backend.py``: ``ArcticBackend``, SkyRL's ``AbstractBackend`` over the client.
- ``batch.py``: Tinker datums to arctic-rl batches (pure functions).
- ``losses.py``: Tinker's losses as arctic-rl registered losses (``tinker.*``).
- ``compat.py``: the patches SkyRL 0.4.0 needs (Python 3.11 import, backend registration, engine command).
- ``launch.py``: the ``serve`` / ``engine`` entry points.

Nothing is imported here, so importing the package never needs SkyRL installed.
"""
