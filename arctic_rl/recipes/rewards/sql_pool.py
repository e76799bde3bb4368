"""SQL queries on the reward worker pool (``pool.py``): spawned, memory-limited workers that never
write files run read-only queries with a per-query deadline and are killed and replaced when they
overrun it or die; ``score_sql`` scores a batch of predictions against gold queries, counting
timeouts instead of failing the run."""

from __future__ import annotations

from dataclasses import dataclass

from arctic_rl.recipes.rewards.pool import WorkerPool
from arctic_rl.recipes.rewards.sql import QueryLimits, QueryResult, execute_readonly, execution_score

GRACE_S = 1.0  # past its own deadline a worker gets this long to answer before it is killed


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
        self.limits = limits
        self.workers = WorkerPool(execute_readonly, num_workers, limits.timeout_s + GRACE_S, memory_mb, write_files=False)

    @property
    def replaced(self) -> int:
        """Workers killed (overran their deadline) or found dead, and started again."""
        return self.workers.replaced

    def run(self, jobs: list[tuple[str, str]]) -> list[QueryResult]:
        """Run ``(db_path, sql)`` jobs; results in order. A job whose worker overruns the deadline by
        ``GRACE_S`` is a ``timeout``, one whose worker dies an ``error``; neither raises."""
        results = self.workers.run([(db_path, sql, self.limits) for db_path, sql in jobs])
        return [r.value if r.status == "ok" else QueryResult(r.status, message=r.message) for r in results]

    def close(self) -> None:
        self.workers.close()

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
