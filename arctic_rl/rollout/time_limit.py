"""A wall-clock limit on one call of user code (a reward function), so that no call can stall a step.

On the main thread the limit is a ``SIGALRM`` timer whose handler raises in the running call: that stops
Python loops, ``time.sleep`` and the standard library's regular-expression engine (which checks for
signals while it matches), the usual ways a reward hangs on a degenerate completion. Elsewhere (the
look-ahead rollout thread of ``max_staleness >= 1``) signals cannot reach the call, so it runs on a
daemon helper thread while the caller waits at most the limit; a call stuck inside C code that holds the
GIL delays that error until it returns. Either way the caller gets :class:`CallTimedOut`.

:func:`call_on_thread` always runs the call on a daemon thread of its own: its time limit does not depend on the
call letting an exception through (an environment's tool that catches ``Exception`` in a retry loop would
swallow the alarm's), and a call past its limit is abandoned, its thread returned with the error, still running
until the call returns.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class CallTimedOut(TimeoutError):
    """A call ran past its time limit; ``thread``: the daemon thread left running it (None: the alarm stopped it)."""

    def __init__(self, message: str, thread: threading.Thread | None = None) -> None:
        super().__init__(message)
        self.thread = thread


def call_with_time_limit(fn: Callable[[], T], seconds: float | None) -> T:
    """``fn()``, raising :class:`CallTimedOut` once it has run ``seconds`` (None: no limit)."""
    if seconds is None:
        return fn()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _with_alarm(fn, seconds)
    return call_on_thread(fn, seconds, "arctic-rl-reward")


def _with_alarm(fn: Callable[[], T], seconds: float) -> T:
    """Under a ``SIGALRM`` timer; a timer the caller already runs (pytest-timeout's, say) keeps its deadline
    and handler: whichever is due first fires, and the caller's is re-armed afterwards."""
    started = time.monotonic()
    deadline = started + seconds
    previous = signal.getsignal(signal.SIGALRM)
    their_remaining, their_interval = signal.getitimer(signal.ITIMER_REAL)
    theirs = started + their_remaining if their_remaining and callable(previous) else None
    their_fired = []

    def on_alarm(signum, frame):
        now = time.monotonic()
        if theirs is not None and not their_fired and now >= theirs - 1e-3 and now < deadline - 1e-3:
            their_fired.append(now)
            previous(signum, frame)  # the caller's timer came due first; ours goes on
            signal.setitimer(signal.ITIMER_REAL, deadline - time.monotonic())
            return
        raise CallTimedOut(f"still running after {seconds:g} s")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, their_remaining) if theirs is not None else seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if theirs is not None and not their_fired:
            signal.setitimer(signal.ITIMER_REAL, max(theirs - time.monotonic(), 1e-3), their_interval)
        elif theirs is not None and their_interval:
            signal.setitimer(signal.ITIMER_REAL, their_interval, their_interval)


def call_on_thread(fn: Callable[[], T], seconds: float, name: str) -> T:
    """``fn()`` on a new daemon thread named ``name``, waiting at most ``seconds`` for it: past them,
    :class:`CallTimedOut` carrying the thread, which runs on until ``fn`` returns (a daemon: it does not keep the
    process alive). ``fn``'s exception, ``BaseException`` included, is raised in the caller."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller)
            box["error"] = e

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise CallTimedOut(f"still running after {seconds:g} s (left running on a daemon thread)", worker)
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
