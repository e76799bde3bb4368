"""``OperationQueue``: the Tinker transport's operations, run one at a time in arrival order by one worker
thread, each answering a ``concurrent.futures.Future``; consecutive operations that share a batch key (the
SDK's concurrent ``sample`` requests of one step, with the same settings) run as one call of their batch
function, so the engine sees them in one batch (a batch waits ``linger_s`` for more of its kind to arrive)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    """One operation: ``run()``, or, with a ``key``, one item of ``batch(items) -> results`` (an exception in
    ``results`` fails that item alone)."""

    run: Callable[[], Any] | None = None
    key: Hashable | None = None
    batch: Callable[[list[Any]], list[Any]] | None = None
    item: Any = None
    future: Future = field(default_factory=Future)


class OperationQueue:
    """Operations in arrival order, one at a time (the training core runs one operation at a time anyway)."""

    def __init__(self, name: str = "tinker-operations", linger_s: float = 0.01) -> None:
        self.linger_s = linger_s  # how long a batch waits for more of its kind (the SDK sends a step's samples at once)
        self._jobs: deque[Job] = deque()
        self._ready = threading.Condition()
        self._closed = False
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def submit(self, job: Job) -> Future:
        with self._ready:
            if self._closed:
                raise RuntimeError("the operation queue is closed")
            self._jobs.append(job)
            self._ready.notify()
        return job.future

    def close(self) -> None:
        """Stop taking jobs; the ones still queued are cancelled (the one running finishes)."""
        with self._ready:
            self._closed = True
            while self._jobs:
                self._jobs.popleft().future.cancel()
            self._ready.notify()

    def _next(self) -> list[Job]:
        """The next job, with the queued jobs right behind it that share its batch key."""
        with self._ready:
            while not self._jobs and not self._closed:
                self._ready.wait()
            if not self._jobs:
                return []
            jobs = [self._jobs.popleft()]
            while jobs[0].key is not None:
                while self._jobs and self._jobs[0].key == jobs[0].key:
                    jobs.append(self._jobs.popleft())
                if self._jobs or self._closed or not self._ready.wait(self.linger_s):
                    break  # another kind of job is next, or none arrived within linger_s
            return [job for job in jobs if job.future.set_running_or_notify_cancel()]

    def _work(self) -> None:
        while not self._closed or self._jobs:
            jobs = self._next()
            if not jobs:
                continue
            try:
                results = [jobs[0].run()] if jobs[0].key is None else jobs[0].batch([job.item for job in jobs])
            except BaseException as e:  # noqa: BLE001  (the operation's failure is its future's answer)
                results = [e] * len(jobs)
            for job, result in zip(jobs, results):
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)
