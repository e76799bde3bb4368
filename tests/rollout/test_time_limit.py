"""``call_with_time_limit``: a reward that hangs (a backtracking regex, a sleep, a Python loop) is stopped at
its limit on the main thread and on the look-ahead rollout thread; results, errors and any SIGALRM handler
of the caller come through unchanged."""

from __future__ import annotations

import re
import signal
import threading
import time

import pytest

from arctic_rl.rollout.time_limit import CallTimedOut, call_with_time_limit

def spin(seconds: float) -> None:
    """A pure-Python busy loop of ``seconds`` (no memory growth: what a call left running may keep doing)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


HANGS = {
    "backtracking_regex": lambda: re.match(r"(a+)+$", "a" * 64 + "b"),  # 2**64 steps: never returns by itself
    "sleep": lambda: time.sleep(60),
    "python_loop": lambda: spin(3.0),  # 10x the limit; a call left running on a daemon thread ends by itself
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("hang", list(HANGS))
def test_a_hanging_call_is_stopped_at_its_limit_on_the_main_thread(hang):
    with pytest.raises(CallTimedOut, match=r"still running after 0.3 s"):  # had it finished, nothing would raise
        call_with_time_limit(HANGS[hang], 0.3)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("hang", ["sleep", "python_loop"])
def test_a_hanging_call_is_stopped_at_its_limit_off_the_main_thread(hang):
    caught: list[BaseException] = []

    def rollout_thread():
        try:
            call_with_time_limit(HANGS[hang], 0.3)
        except BaseException as e:  # noqa: BLE001
            caught.append(e)

    thread = threading.Thread(target=rollout_thread)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and len(caught) == 1 and isinstance(caught[0], CallTimedOut)


def test_results_errors_and_the_callers_alarm_handler_come_through():
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGALRM, mine)
    try:
        assert call_with_time_limit(lambda: 42, 5.0) == 42
        with pytest.raises(ZeroDivisionError):
            call_with_time_limit(lambda: 1 / 0, 5.0)
        assert signal.getsignal(signal.SIGALRM) is mine
        assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0 or signal.getitimer(signal.ITIMER_REAL)[0] > 5  # ours is gone (pytest-timeout's may run)
        assert call_with_time_limit(lambda: "no limit", None) == "no limit"
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_a_timer_the_caller_runs_keeps_its_deadline_and_handler():
    events: list[str] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: events.append("theirs"))
    before = signal.setitimer(signal.ITIMER_REAL, 0.2)  # the caller's: due while our call runs
    try:
        with pytest.raises(CallTimedOut):
            call_with_time_limit(lambda: time.sleep(5), 0.5)
        events.append("ours")
        assert events == ["theirs", "ours"]  # theirs fired at its time, once, inside the call; ours after it
        assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0  # theirs was due already: not re-armed
        assert signal.getsignal(signal.SIGALRM) is not None and events.count("theirs") == 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, *before)
        signal.signal(signal.SIGALRM, previous)
