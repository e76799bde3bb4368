"""``OverlappedRollouts``: generate the next rollout batch while the trainer updates on this one.

With ``RolloutCallback(max_staleness=k)``, k >= 1, a step t runs as:

    on_train_batch_start(t): take batch t's rollout (generated during step t-1; the first step of a run
                             or of an epoch generates it now), then start generating batch t+1 in a
                             background thread from the engine's current weights
    training_step(t):        the update, concurrent with that generation
    on_train_batch_end(t):   wait for batch t+1's rollout, then push the new weights unless the engine
                             may lag one more step (``needs_sync``)

Batch t+1 is generated with the weights of step t (k = 1) or, when pushes are skipped (k >= 2), of a
step no older than t-k+1: its *staleness* (steps between the weights that sampled it and the weights
that train on it) is at most k, logged as ``rollout/staleness``. A stale batch carries the sampler's
log-probs as its old policy (``old_logprobs``), so the clipped PPO ratio is taken against the behaviour
policy that generated it. The engine takes one call at a time, so the weight push never waits for
anything but the transfer itself: generation is finished before it starts.

Sampling seeds are those of the synchronous run (``engines/seeds.py``: a function of seed, step, prompt slot and
sample): batch t+1 is generated for the step that trains on it, whatever step is running meanwhile.
The rollout in flight at a checkpoint is saved with it (:meth:`state_dict`), so a resume continues with
the same samples and staleness as the uninterrupted run (k = 1; see docs/algorithms.md for k >= 2).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

from arctic_rl.data.prompts import PROMPT_IDS
from arctic_rl.rollout.batch import RolloutBatch

Generate = Callable[[dict, int], tuple[RolloutBatch, dict[str, float]]]  # (batch, step) -> (rollout, metrics)


@dataclass
class PendingRollout:
    """A rollout generated (or being generated) ahead of the step that trains on it."""

    step: int  # global step that will train on it (its sampling seeds are this step's)
    weights_step: int  # global step whose weights the engine held when it generated
    prompt_ids: list[list[int]]  # the batch's prompts, to check it is the batch Lightning hands over
    future: Future

    def result(self) -> tuple[RolloutBatch, dict[str, float]]:
        return self.future.result()


class OverlappedRollouts:
    """The look-ahead of one rollout batch and the engine's weight version (see the module docstring).

    Args:
        generate: ``(batch, step) -> (rollout, metrics)``, the synchronous rollout of ``batch`` for ``step``.
        max_staleness: k >= 1, the most steps the weights that sampled a batch may lag the trainer's.
        steps_per_batch: optimizer steps per rollout batch (``mini_batches``): the global step's unit.
        weights_step: global step of the weights the engine starts with.
        behaviour_as_old: give a stale batch the sampler's log-probs as PPO's old policy (False: leave it to
            the trainer, as the mismatch correction needs).
    """

    def __init__(self, generate: Generate, max_staleness: int, steps_per_batch: int, weights_step: int,
                 behaviour_as_old: bool = True) -> None:
        if max_staleness < 1:
            raise ValueError(f"OverlappedRollouts needs max_staleness >= 1, got {max_staleness}")
        self.generate, self.max_staleness, self.steps_per_batch = generate, max_staleness, steps_per_batch
        self.weights_step, self.behaviour_as_old = weights_step, behaviour_as_old
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arctic-rl-rollout")
        self._pending: PendingRollout | None = None
        self.wait_s = 0.0  # time the trainer spent waiting for rollouts since the last read

    def staleness(self, step: int, weights_step: int) -> int:
        """Rollout batches between the weights that sampled a batch and the step that trains on it."""
        return (step - weights_step) // self.steps_per_batch

    def take(self, batch: dict, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """The rollout of ``batch`` for ``step``: the one generated ahead when it is this batch's, else
        generated now. A stale rollout gets the sampler's log-probs as its old policy."""
        pending, self._pending = self._pending, None
        started = time.perf_counter()
        if pending is not None and pending.step == step and pending.prompt_ids == batch[PROMPT_IDS]:
            (rollout, metrics), weights_step = pending.result(), pending.weights_step
        else:
            if pending is not None:
                pending.future.exception()  # let it finish (the engine is busy until then); its samples are unused
                warnings.warn(f"rollout generated ahead for step {pending.step} does not match the batch of step {step};"
                              " generating this batch now", RuntimeWarning, stacklevel=2)
            (rollout, metrics), weights_step = self.generate(batch, step), self.weights_step
        self.wait_s += time.perf_counter() - started
        staleness = self.staleness(step, weights_step)
        if staleness > 0 and self.behaviour_as_old:  # PPO's old policy is the behaviour policy that sampled the batch
            rollout.old_logprobs = rollout.sampler_logprobs.clone()
        return rollout, {**metrics, "rollout/staleness": float(staleness)}

    def launch(self, batch: dict, step: int) -> None:
        """Start generating ``batch`` (the next one) for ``step`` with the engine's current weights."""
        if self._pending is not None:
            raise RuntimeError(f"a rollout for step {self._pending.step} is still pending")
        future = self._executor.submit(self.generate, batch, step)
        self._pending = PendingRollout(step, self.weights_step, [list(p) for p in batch[PROMPT_IDS]], future)

    def finish_pending(self) -> None:
        """Wait until the rollout generated ahead is complete (before the engine may take new weights);
        its error, if any, is raised here."""
        if self._pending is not None:
            started = time.perf_counter()
            self._pending.future.result()
            self.wait_s += time.perf_counter() - started

    def needs_sync(self, global_step: int) -> bool:
        """After the update that reached ``global_step``: must the engine take the new weights now?
        Yes unless the batch generated next (two batches on, at the start of the next step) would still
        be at most ``max_staleness`` behind with the engine's current weights."""
        return self.staleness(global_step + self.steps_per_batch, self.weights_step) > self.max_staleness

    def synced(self, global_step: int) -> None:
        self.weights_step = global_step

    def pop_wait_s(self) -> float:
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def close(self) -> None:
        """Wait for a generation in flight (the engine is about to be shut down) and stop the thread."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._pending = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The rollout generated ahead, complete, as plain tensors and lists (a checkpoint loads it with
        ``weights_only``); empty when there is none."""
        if self._pending is None:
            return {}
        rollout, metrics = self._pending.result()
        return {"step": self._pending.step, "weights_step": self._pending.weights_step,
                "prompt_ids": self._pending.prompt_ids, "rollout": asdict(rollout), "metrics": dict(metrics)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        done: Future = Future()
        done.set_result((RolloutBatch(**state["rollout"]), dict(state["metrics"])))
        self._pending = PendingRollout(state["step"], state["weights_step"], state["prompt_ids"], done)




def engine_stream(device: str | None) -> torch.cuda.Stream | None:
    """A CUDA stream of its own for an in-process engine on ``device`` (None off CUDA, or for Ray engines)."""
    return torch.cuda.Stream(device=device) if device is not None and torch.device(device).type == "cuda" else None


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None, wait: bool = True) -> Iterator[None]:
    """Run this thread's enclosed CUDA work on ``stream``, so an in-process engine's kernels run beside
    training's instead of queueing behind them on the default stream. The stream first waits for the
    default stream (where the weights the engine reads were written; ``wait=False``: the caller made it wait
    already) and is drained at the end."""
    if stream is None:
        yield
        return
    if wait:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()
