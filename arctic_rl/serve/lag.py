"""How far the engines' weights are behind the trainer's, as the service's front sees it: every call that moves either
passes through the front (``optim_step`` moves the trainer's; ``sync_weights``, and ``load_state``, which syncs,
bring the engines level). ``sample(max_staleness=k)`` pushes the weights first when they are more than ``k``
optimizer steps behind: the bound of ``fit``'s ``RolloutCallback.max_staleness``, for a client that runs its own
loop (one step off-policy: ``k = 1`` syncs every other step)."""

from __future__ import annotations

from typing import Any

from arctic_rl.serve.errors import RequestError


def check_max_staleness(value: Any) -> None:
    """``sample``'s ``max_staleness``: None, or an integer >= 0 (``RequestError`` otherwise)."""
    if value is not None and (type(value) is not int or value < 0):
        raise RequestError(f"max_staleness must be an integer >= 0 (optimizer steps) or null, got {value!r}")


class WeightLag:
    """Optimizer steps the engines' weights are behind the trainer's (0 at start: the engines start from them)."""

    def __init__(self) -> None:
        self.behind = 0

    def stepped(self, result: dict[str, Any]) -> None:
        """After ``optim_step``: one more step, unless it was skipped (a non-finite gradient) or replayed."""
        if not result.get("step_skipped") and not result.get("replayed"):
            self.behind += 1

    def synced(self) -> None:
        self.behind = 0

    def needs_sync(self, max_staleness: int | None) -> bool:
        return max_staleness is not None and self.behind > max_staleness
