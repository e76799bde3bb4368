"""The house's time limit for rewards: a pool of spawned worker processes, each running one picklable
function per job under a wall-clock deadline, killed and replaced when it overruns it or dies, so a
job that hangs costs its deadline and never a training step. ``SQLWorkerPool`` (``sql_pool.py``) runs
queries on it; ``SampleScorer`` scores the GSM8K and multi-hop QA rewards one sample per job.

Only a separate process can be stopped at any point: a thread cannot be killed, and a signal reaches
only the main thread, while rollouts may be scored on a background one (``rollout/overlap.py``).
This module stays light (no torch): each worker imports it.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

log = logging.getLogger(__name__)
STARTUP_S = 60.0  # a spawned worker has this long to import its function and report ready
READY = "ready"


@dataclass(frozen=True)
class JobResult:
    """What one job did: ``ok`` with the function's ``value``, ``error`` (it raised, or its worker died)
    or ``timeout`` (its worker overran the deadline and was killed)."""

    status: Literal["ok", "error", "timeout"]
    value: Any = None
    message: str = ""


def _worker_main(conn: Connection, fn: Callable, memory_bytes: int, write_files: bool) -> None:
    """Cap the address space (and file writes), report ready, then serve argument tuples until ``None``."""
    import resource

    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    if not write_files:
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    conn.send(READY)
    while (args := conn.recv()) is not None:
        try:
            result = JobResult("ok", fn(*args))
        except MemoryError:
            result = JobResult("error", message="out of memory")
        except Exception as e:  # noqa: BLE001  (reported to the caller with the job)
            result = JobResult("error", message=f"{type(e).__name__}: {e}")
        conn.send(result)


class _Worker:
    def __init__(self, ctx, fn: Callable, memory_bytes: int, write_files: bool) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, fn, memory_bytes, write_files), daemon=True)
        self.process.start()
        child.close()

    def wait_ready(self) -> None:
        if not self.conn.poll(STARTUP_S):
            self.kill()
            raise RuntimeError(f"a reward worker process did not start within {STARTUP_S:.0f} s")
        try:
            self.conn.recv()  # READY
        except EOFError:
            self.process.join()
            raise RuntimeError(f"a reward worker process exited while starting (exit code {self.process.exitcode})") from None

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class WorkerPool:
    """``num_workers`` spawned processes running ``fn(*args)`` for each job, each job within
    ``timeout_s`` of wall-clock time; the constructor returns once every worker is ready. Use as a
    context manager, or call ``close()``.

    Args:
        fn: a module-level function (workers import it by name); its arguments and result must pickle.
        num_workers: jobs run in parallel.
        timeout_s: a job's worker is killed (and replaced) when it has not answered after this long.
        memory_mb: RLIMIT_AS of each worker (0: none).
        write_files: False caps each worker's file writes at 0 bytes.
    """

    def __init__(self, fn: Callable, num_workers: int = 2, timeout_s: float = 5.0, memory_mb: int = 0,
                 write_files: bool = True) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s}")
        self.fn, self.timeout_s = fn, timeout_s
        self._options = (memory_mb << 20, write_files)
        self._ctx = mp.get_context("spawn")  # no fork of a process holding CUDA, threads or a vLLM engine
        self._workers = [self._start() for _ in range(num_workers)]
        for worker in self._workers:  # started together, so waited for in parallel
            worker.wait_ready()
        self.replaced = 0  # workers killed (overran the deadline) or found dead, and started again

    @property
    def pids(self) -> list[int]:
        """The process id of each worker."""
        return [w.process.pid for w in self._workers]

    def run(self, jobs: list[tuple]) -> list[JobResult]:
        """Run ``fn(*job)`` for each job; results in order. A job whose worker has not answered within
        ``timeout_s`` is a ``timeout``, one whose worker dies an ``error``; neither raises."""
        results: list[JobResult | None] = [None] * len(jobs)
        pending = list(range(len(jobs)))[::-1]
        idle, busy = list(self._workers), {}  # busy: worker -> (job index, deadline)
        while pending or busy:
            while pending and idle:
                worker, i = idle.pop(), pending.pop()
                try:
                    worker.conn.send(jobs[i])
                except OSError:  # it died while idle
                    worker = self._replace(worker)
                    worker.conn.send(jobs[i])
                busy[worker] = (i, time.monotonic() + self.timeout_s)
            timeout = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
            ready = wait([w.conn for w in busy], timeout=timeout)
            for worker, (i, deadline) in list(busy.items()):
                if worker.conn in ready:
                    try:
                        results[i] = worker.conn.recv()
                    except (EOFError, OSError):
                        results[i] = JobResult("error", message="worker died")
                        idle.append(self._replace(worker))
                    else:
                        idle.append(worker)
                elif time.monotonic() > deadline:
                    results[i] = JobResult("timeout", message=f"no answer within {self.timeout_s:g} s; worker killed")
                    idle.append(self._replace(worker))
                else:
                    continue
                del busy[worker]
        return results

    def _start(self) -> _Worker:
        return _Worker(self._ctx, self.fn, *self._options)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = self._start()
        fresh.wait_ready()
        self._workers[self._workers.index(worker)] = fresh
        self.replaced += 1
        return fresh

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
            worker.process.join(timeout=1)
            if worker.process.is_alive():
                worker.process.kill()
            worker.conn.close()
        self._workers = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RewardTimeout(RuntimeError):
    """A sample's reward ran past its time limit and no fallback score is configured."""


class SampleScorer:
    """Scores samples with ``fn(*job)`` in a ``WorkerPool`` (started on first use), each sample within
    ``timeout_s``; a sample over it scores ``fallback``, or raises ``RewardTimeout`` naming the sample
    and the limit when ``fallback`` is None. A sample whose ``fn`` raised raises ``ValueError`` naming it.

    Args:
        fn: the per-sample reward, a module-level function returning a float.
        num_workers: worker processes.
        timeout_s: the time limit of one sample.
        fallback: the score of a sample over the limit; None: stop with an error.
        field: the config key prefix that messages name (``model.reward``).
    """

    def __init__(self, fn: Callable[..., float], num_workers: int, timeout_s: float, fallback: float | None,
                 field: str = "model.reward") -> None:
        from arctic_rl.errors import ConfigError

        if num_workers < 1:
            raise ConfigError(f"{field}_workers must be >= 1, got {num_workers}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ConfigError(f"{field}_timeout_s must be a finite number of seconds > 0, got {timeout_s}")
        if fallback is not None and not math.isfinite(fallback):
            raise ConfigError(f"{field}_fallback must be a finite score or null, got {fallback}")
        self.fn, self.num_workers, self.timeout_s, self.fallback, self.field = fn, num_workers, timeout_s, fallback, field
        self._pool: WorkerPool | None = None
        self.timeouts = 0  # samples over the limit that scored the fallback, since the start

    def score(self, jobs: list[tuple], completions: list[str]) -> list[float]:
        """One score per job (``completions[i]`` is job ``i``'s completion, for messages)."""
        if self._pool is None:
            self._pool = WorkerPool(self.fn, self.num_workers, self.timeout_s)
        scores = []
        for i, result in enumerate(self._pool.run(jobs)):
            where = f"sample {i} (completion {completions[i][:80]!r}, {len(completions[i])} characters)"
            if result.status == "ok":
                scores.append(result.value)
            elif result.status == "timeout" and self.fallback is not None:
                scores.append(self.fallback)
                self.timeouts += 1
                log.warning("%s took over %s_timeout_s=%g s on %s: scored %s_fallback=%g",
                            self.fn.__name__, self.field, self.timeout_s, where, self.field, self.fallback)
            elif result.status == "timeout":
                raise RewardTimeout(f"{self.fn.__name__} took over {self.field}_timeout_s={self.timeout_s:g} s on {where};"
                                    f" set {self.field}_fallback to score such samples instead of stopping")
            else:
                raise ValueError(f"{self.fn.__name__} failed on {where}: {result.message}")
        return scores

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
