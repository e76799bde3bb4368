"""The address ``ray.init`` gets for an unset ``ray.address``: ``$RAY_ADDRESS`` when set, else a new local cluster."""

from __future__ import annotations

import os


def init_address(address: str | None) -> str:
    """``address`` as given; unset: ``$RAY_ADDRESS`` when set, else ``"local"`` (a new cluster started here). Ray's own
    reading of ``None`` joins whichever cluster ``/tmp/ray/ray_current_cluster`` names last, another user's included."""
    return address or os.environ.get("RAY_ADDRESS") or "local"
