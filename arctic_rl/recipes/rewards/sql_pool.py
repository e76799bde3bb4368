"""A pool of SQL worker processes (spawned, memory-limited) that run read-only queries with a
per-query deadline, kill and replace a worker that overruns it or dies, and score a batch of
predictions against gold queries (``score_sql``), counting timeouts instead of failing the run."""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from arctic_rl.recipes.rewards.sql import QueryLimits, QueryResult, execute_readonly, execution_score

GRACE_S = 1.0  # past its own deadline a worker gets this long to answer before it is killed


def _worker_main(conn: Connection, memory_bytes: int) -> None:
    """Serve ``(db_path, sql, limits)`` jobs until ``None``; the address space is capped first."""
    import resource

    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # a worker never writes files
    while (job := conn.recv()) is not None:
        try:
            result = execute_readonly(*job)
        except MemoryError:
            result = QueryResult("error", message="out of memory")
        conn.send(result)


class _Worker:
    def __init__(self, ctx, memory_bytes: int) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, memory_bytes), daemon=True)
        self.process.start()
        child.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


@dataclass(frozen=True)
class SQLScores:
    """Scores of a batch, and how many predictions timed out or failed, and gold queries that failed."""

    scores: list[float]
    timeouts: int
    errors: int
    gold_failures: int


class SQLWorkerPool:
    """``num_workers`` spawned processes, each limited to ``memory_mb`` of address space, running
    queries under ``limits``. Use as a context manager, or call ``close()``.

    Args:
        num_workers: queries run in parallel.
        limits: per-query timeout and result caps.
        memory_mb: RLIMIT_AS of each worker (0: none).
    """

    def __init__(self, num_workers: int = 4, limits: QueryLimits = QueryLimits(), memory_mb: int = 1024) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.limits, self._memory_bytes = limits, memory_mb << 20
        self._ctx = mp.get_context("spawn")  # no fork of a process holding CUDA, threads or a vLLM engine
        self._workers = [_Worker(self._ctx, self._memory_bytes) for _ in range(num_workers)]
        self.replaced = 0  # workers killed (overran their deadline) or found dead, and started again

    def run(self, jobs: list[tuple[str, str]]) -> list[QueryResult]:
        """Run ``(db_path, sql)`` jobs; results in order. A job whose worker overruns the deadline by
        ``GRACE_S`` is a ``timeout``, one whose worker dies is an ``error``; neither raises."""
        results: list[QueryResult | None] = [None] * len(jobs)
        pending = list(range(len(jobs)))[::-1]
        idle, busy = list(self._workers), {}  # busy: worker -> (job index, hard deadline)
        while pending or busy:
            while pending and idle:
                worker, i = idle.pop(), pending.pop()
                try:
                    worker.conn.send((*jobs[i], self.limits))
                except OSError:  # it died while idle
                    worker = self._replace(worker)
                    worker.conn.send((*jobs[i], self.limits))
                busy[worker] = (i, time.monotonic() + self.limits.timeout_s + GRACE_S)
            timeout = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
            ready = wait([w.conn for w in busy], timeout=timeout)
            for worker, (i, deadline) in list(busy.items()):
                if worker.conn in ready:
                    try:
                        results[i] = worker.conn.recv()
                    except (EOFError, OSError):
                        results[i] = QueryResult("error", message="worker died")
                        idle.append(self._replace(worker))
                    else:
                        idle.append(worker)
                elif time.monotonic() > deadline:
                    results[i] = QueryResult("timeout", message=f"worker overran {self.limits.timeout_s}s; killed")
                    idle.append(self._replace(worker))
                else:
                    continue
                del busy[worker]
        return results

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self._ctx, self._memory_bytes)
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

    def __enter__(self) -> SQLWorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def score_sql(pool: SQLWorkerPool, db_paths: list[str], predictions: list[str], golds: list[str]) -> SQLScores:
    """Execution-match scores of ``predictions`` against ``golds`` on ``db_paths``; each distinct gold
    query runs once (a GRPO group shares it)."""
    gold_jobs = sorted(set(zip(db_paths, golds)))
    gold_results = dict(zip(gold_jobs, pool.run(gold_jobs)))
    predicted = pool.run(list(zip(db_paths, predictions)))
    scores = [execution_score(p, gold_results[(d, g)], g) for p, d, g in zip(predicted, db_paths, golds)]
    return SQLScores(
        scores=scores,
        timeouts=sum(p.status == "timeout" for p in predicted),
        errors=sum(p.status == "error" for p in predicted),
        gold_failures=sum(r.status != "ok" for r in gold_results.values()),
    )
