"""Which registered loss a SkyRL ``forward_backward`` runs, and with what config (pure: no SkyRL import).

A request's Tinker ``loss_fn`` runs, in this order: the registered arctic-rl loss that the backend config's
``loss_fns`` routes it to (``{"ppo": {"loss": "my_loss", "config": {...}}}``: the route's config, then the
request's ``loss_fn_config`` over it); Tinker's own loss of that name, registered as ``tinker.<loss_fn>``
(``serve/tinker/losses.py``); a registered arctic-rl loss of that name (a plugin's, with the request's
``loss_fn_config``). Anything else is refused, listing both. Every name is looked up in the one loss registry.

SkyRL 0.4.0's API server accepts only its own ``loss_fn`` names (and ``loss_fn_config`` keys per name), and the
``tinker`` SDK only its own, so from the SDK a plugin loss is reached through a route.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from arctic_rl.loss_registry import PLUGIN_HINT, is_loss, loss_names
from arctic_rl.serve.tinker.losses import PREFIX


class LossRoute(BaseModel):
    """A registered arctic-rl loss that a Tinker ``loss_fn`` runs instead of Tinker's own, with its config."""

    model_config = ConfigDict(extra="forbid")

    loss: str = Field(description="A registered arctic-rl loss's name (loss_registry.py; plugins add more).")
    config: dict[str, Any] = Field(default_factory=dict, description="Its loss config; the request's loss_fn_config goes over it.")


def tinker_losses() -> list[str]:
    """Tinker's losses arctic-rl serves (registered as ``tinker.<name>``), by their Tinker names."""
    return [name.removeprefix(PREFIX) for name in loss_names() if name.startswith(PREFIX)]


def check_routes(routes: Mapping[str, LossRoute], accepted: Iterable[str]) -> None:
    """Each routed ``loss_fn`` is one SkyRL's API accepts (``accepted``) and each route's loss is registered
    (plugins loaded); ``ValueError`` naming ``loss_fns.<loss_fn>`` otherwise."""
    accepted = list(accepted)
    for loss_fn, route in routes.items():
        if loss_fn not in accepted:
            raise ValueError(f"backend arctic: loss_fns.{loss_fn}: SkyRL's API accepts the loss_fn names {accepted} only")
        if not is_loss(route.loss) or route.loss.startswith(PREFIX):
            plugins = [name for name in loss_names() if not name.startswith(PREFIX)]
            raise ValueError(f"backend arctic: loss_fns.{loss_fn}.loss={route.loss!r} is not a registered arctic-rl loss; "
                             f"known: {plugins}{PLUGIN_HINT}")


def choose_loss(loss_fn: str, loss_fn_config: Mapping[str, Any] | None,
                routes: Mapping[str, LossRoute]) -> tuple[str, dict[str, Any], bool]:
    """``(registered loss name, its loss config, whether it is Tinker's own)`` for a request's ``loss_fn`` and
    ``loss_fn_config`` (module docstring's order); ``ValueError`` naming ``loss_fn`` when nothing has that name."""
    config = dict(loss_fn_config or {})
    if loss_fn in routes:
        return routes[loss_fn].loss, {**routes[loss_fn].config, **config}, False
    if is_loss(PREFIX + loss_fn):
        return PREFIX + loss_fn, config, True
    if is_loss(loss_fn) and not loss_fn.startswith(PREFIX):
        return loss_fn, config, False
    plugins = [name for name in loss_names() if not name.startswith(PREFIX)]
    raise ValueError(f"loss_fn {loss_fn!r} is neither one of Tinker's losses arctic-rl serves {tinker_losses()} nor a "
                     f"registered arctic-rl loss {plugins}{PLUGIN_HINT}")
