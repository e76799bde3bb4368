"""``OperationQueue``: arrival order, one at a time, and consecutive jobs of one batch key run as one batch
call (a failing item fails alone)."""

from __future__ import annotations

import threading

import pytest

from arctic_rl.serve.tinker.queue import Job, OperationQueue


def test_consecutive_jobs_of_one_key_run_as_one_batch_in_order():
    queue, gate, calls = OperationQueue(), threading.Event(), []

    def batch(items):
        calls.append(list(items))
        return [ValueError(f"bad {x}") if x == "c" else x.upper() for x in items]

    blocker = queue.submit(Job(run=gate.wait))  # holds the worker while the rest queue up
    keyed = [queue.submit(Job(key="k", batch=batch, item=x)) for x in "abc"]
    plain = queue.submit(Job(run=lambda: calls.append("plain") or "p"))
    last = queue.submit(Job(key="k", batch=batch, item="d"))
    other = queue.submit(Job(key="other", batch=batch, item="e"))
    gate.set()
    assert blocker.result(5) is True
    assert [f.result(5) for f in keyed[:2]] == ["A", "B"]
    with pytest.raises(ValueError, match="bad c"):
        keyed[2].result(5)
    assert plain.result(5) == "p" and last.result(5) == "D" and other.result(5) == "E"
    assert calls == [["a", "b", "c"], "plain", ["d"], ["e"]]
    queue.close()


def test_close_cancels_what_is_still_queued():
    queue, gate, started = OperationQueue(), threading.Event(), threading.Event()
    running = queue.submit(Job(run=lambda: started.set() or gate.wait()))
    queued = queue.submit(Job(run=lambda: 1))
    assert started.wait(5)
    queue.close()
    gate.set()
    assert running.result(5) is True and queued.cancelled()
    with pytest.raises(RuntimeError, match="closed"):
        queue.submit(Job(run=lambda: 1))


def test_a_batch_waits_briefly_for_more_of_its_kind():
    """Jobs of one key that arrive within ``linger_s`` of each other join one batch, even with the worker idle."""
    queue, calls = OperationQueue(linger_s=0.5), []
    futures = [queue.submit(Job(key="k", batch=lambda items: calls.append(list(items)) or items, item=i)) for i in range(3)]
    assert [f.result(5) for f in futures] == [0, 1, 2] and calls == [[0, 1, 2]]
    queue.close()
