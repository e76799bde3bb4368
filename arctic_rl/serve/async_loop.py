"""``run_async``: an asynchronous training loop over ``ArcticRLClient``, the shape of verl's fully-async mode and
SkyRL's fully-async trainer. A producer thread runs the caller's rollouts (sampling, rewards, advantages) for
batches n+1..n+k while the trainer trains batch n; every sequence is stamped with the policy version that sampled it,
and the trainer drops a batch sampled more than ``max_staleness`` versions before the policy that would train it.

    def rollout(client, index) -> Rollout:          # the producer thread; yours
        out = client.sample(prompts_of(index), n=8, max_tokens=256, seed=index)
        return Rollout.of(out, advantages_of(out))

    run = run_async(client, rollout, num_steps=100, max_staleness=1)     # run.trained, run.dropped

**Versions.** The policy version is the number of batches this loop has trained (and pushed to the engines): 0 for the
weights at its start, v after the v-th. A batch's staleness is the trainer's version when it trains the batch minus
the oldest version that sampled one of its sequences: fit's ``max_staleness`` unit (rollout batches; with one
optimizer step a batch, the default, optimizer steps). The engines report which weights sampled each completion
(``Samples.weight_versions``, counted in ``sync_weights`` calls); the loop maps them to its versions, since it makes
every sync itself (a rollout that syncs, or samples with ``max_staleness``, is refused: its weights are not a version).

**The bound.** The producer starts batch i only when the trainer is done with batch ``i - max_ahead`` (trained and
pushed, or dropped). With ``max_ahead == max_staleness`` (the default, SkyRL's capacity rule) no batch can go past the
bound, so none is dropped; a larger ``max_ahead`` keeps the producer further ahead (verl's rollouter running on past
its threshold) and the trainer drops what is too old, counted in ``AsyncRun.dropped`` and replaced by a new batch.
Every produced batch is trained once or dropped; the producer never samples past the batches the run needs. A batch
trained stale without ``old_logprobs`` gets the sampler's log-probs as its old policy, as ``fit``'s overlapped
rollouts do, so the clipped ratio is taken against the policy that generated it.

``max_staleness=0`` is the synchronous loop call for call (sample, train, sync), so its samples, losses and weights
are those of the loop written by hand. The service still runs one operation at a time: what overlaps the training
calls is the caller's own work in the producer (rewards, environments, building batches) and the transport, and
with a producer ahead the engines sample the next batch between the trainer's calls without waiting for a step.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from arctic_rl.errors import ConfigError
from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.client import ArcticRLClient, Samples


@dataclass(frozen=True)
class Rollout:
    """One producer batch: the sequences to train on and, for each, the engines' weight version that sampled it."""

    batch: TrainBatch
    weight_versions: list[int]  # [N]: Samples.weight_versions per sequence (a multi-turn one: its oldest turn's)

    def __post_init__(self) -> None:
        if len(self.weight_versions) != self.batch.num_sequences:
            raise ValueError(f"Rollout.weight_versions has {len(self.weight_versions)} versions for "
                             f"{self.batch.num_sequences} sequences; give one per sequence")

    @classmethod
    def of(cls, samples: Samples, advantages, **optional) -> "Rollout":
        """``samples.train_batch(advantages, **optional)`` with each completion's weight version."""
        if samples.weight_versions is None:
            raise ValueError("Samples.weight_versions is None: the server does not report which weights sampled "
                             "each completion, so an asynchronous loop cannot bound their staleness")
        versions = [v for per_prompt in samples.weight_versions for v in per_prompt]
        return cls(samples.train_batch(advantages, **optional), versions)


@dataclass(frozen=True)
class TrainedBatch:
    """A batch the trainer trained on."""

    index: int  # the producer's batch number
    version: int  # the policy version that trained it (batches trained before it)
    sampled_by: list[int]  # [N]: the policy version that sampled each sequence
    metrics: dict[str, Any]  # the train step's answer (default: forward_backward's metrics and optim_step's)

    @property
    def staleness(self) -> int:
        return self.version - min(self.sampled_by)


@dataclass(frozen=True)
class DroppedBatch:
    """A batch the trainer took and dropped: sampled more than ``max_staleness`` versions before ``version``."""

    index: int
    version: int
    sampled_by: list[int]  # [N]

    @property
    def staleness(self) -> int:
        return self.version - min(self.sampled_by)


@dataclass
class AsyncRun:
    """What ``run_async`` did: every batch the producer made is in one of the two lists, once."""

    trained: list[TrainedBatch] = field(default_factory=list)
    dropped: list[DroppedBatch] = field(default_factory=list)


Rollouts = Callable[[ArcticRLClient, int], Rollout]  # (client, batch index) -> the batch; runs in the producer thread
TrainStep = Callable[[ArcticRLClient, TrainBatch], dict[str, Any]]  # one update on a batch, without sync_weights


def train_step(loss: str = "dapo", loss_config: dict[str, Any] | None = None) -> TrainStep:
    """The default update: ``forward_backward(batch, loss, loss_config)`` then ``optim_step()``; answers both's."""

    def step(client: ArcticRLClient, batch: TrainBatch) -> dict[str, Any]:
        metrics = client.forward_backward(batch, loss, loss_config)
        return {**metrics, **client.optim_step()}

    return step


def run_async(client: ArcticRLClient, rollout: Rollouts, num_steps: int, max_staleness: int,
              max_ahead: int | None = None, train: TrainStep | None = None) -> AsyncRun:
    """Train ``num_steps`` batches made by ``rollout`` in a producer thread, each at most ``max_staleness`` stale.

    Args:
        client: the job; the loop pushes the weights (``sync_weights``) after every trained batch.
        rollout: ``rollout(client, index) -> Rollout`` for batch ``index`` (0, 1, ...), in the producer thread: its
            sampling, rewards and advantages. It must not call ``sync_weights`` or ``sample(max_staleness=...)``.
        num_steps: batches to train (>= 1).
        max_staleness: the bound k >= 0, in policy versions (module docstring); 0: the synchronous loop.
        max_ahead: how many batches the producer may run ahead of the trainer (>= ``max_staleness``; None: equal).
        train: one update on a batch (default ``train_step()``: ``dapo``, one ``optim_step``).
    Raises:
        ConfigError: a bad argument. ValueError: a ``Rollout`` the trainer cannot use (named by batch index).
        RuntimeError: the rollout of a batch raised (its error chained), or a sequence was sampled by weights this
            loop did not push.
    """
    for name, value, least in (("num_steps", num_steps, 1), ("max_staleness", max_staleness, 0)):
        if type(value) is not int or value < least:
            raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
    max_ahead = max_staleness if max_ahead is None else max_ahead
    if type(max_ahead) is not int or max_ahead < max_staleness:
        raise ConfigError(f"max_ahead must be an integer >= max_staleness ({max_staleness}) or None, got {max_ahead!r}")
    train = train_step() if train is None else train
    versions = _Versions(_level_weight_version(client))  # also starts the job here, before two threads call it
    run = AsyncRun()
    with _Producer(client, rollout, num_steps, max_ahead) as producer:
        while len(run.trained) < num_steps:
            index, item = producer.next()
            version = len(run.trained)
            sampled_by = versions.of(item.weight_versions, index)
            if version - min(sampled_by) > max_staleness:
                run.dropped.append(DroppedBatch(index, version, sampled_by))
                producer.done_with(dropped=True)
                continue
            batch = item.batch if version == min(sampled_by) else _behaviour_policy(item.batch, index)
            metrics = train(client, batch)
            versions.record(client.sync_weights()["weight_version"], version + 1)
            run.trained.append(TrainedBatch(index, version, sampled_by, metrics))
            producer.done_with(dropped=False)
    return run


def _level_weight_version(client: ArcticRLClient) -> int:
    """The engines' weight version once they hold the trainer's weights (pushed now if they lag or disagree)."""
    status = client.status()
    engine_versions = {replica["weight_version"] for replica in status["engine_replicas"]}
    if status["weights_behind"] == 0 and len(engine_versions) == 1:
        return engine_versions.pop()
    return client.sync_weights()["weight_version"]


def _behaviour_policy(batch: TrainBatch, index: int) -> TrainBatch:
    """A stale batch's old policy is the one that sampled it: the sampler's log-probs, unless the batch has its own."""
    if batch.old_logprobs is not None:
        return batch
    if batch.sampler_logprobs is None:
        raise ValueError(f"batch {index} is stale and has neither old_logprobs nor sampler_logprobs: the trainer needs "
                         "the sampling policy's log-probs for its ratio (Rollout.of attaches the sampler's)")
    return dataclasses.replace(batch, old_logprobs=batch.sampler_logprobs)


class _Versions:
    """The engines' weight versions (``sync_weights`` calls) this loop pushed, mapped to its policy versions."""

    def __init__(self, start: int) -> None:
        self._policy_of = {start: 0}

    def record(self, weight_version: int, policy_version: int) -> None:
        self._policy_of[weight_version] = policy_version

    def of(self, weight_versions: list[int], index: int) -> list[int]:
        unknown = sorted(set(weight_versions) - self._policy_of.keys())
        if unknown:
            raise RuntimeError(f"batch {index} was sampled by engine weight version(s) {unknown}, which this loop did "
                               f"not push (it pushed {sorted(self._policy_of)}): the rollout must not call "
                               "sync_weights, load_state or sample(max_staleness=...)")
        return [self._policy_of[v] for v in weight_versions]


class _Producer:
    """The producer thread: batch i starts once the trainer is done with batch ``i - max_ahead``, and only while the
    run still needs it (``num_steps`` plus one for every batch dropped)."""

    def __init__(self, client: ArcticRLClient, rollout: Rollouts, num_steps: int, max_ahead: int) -> None:
        self._client, self._rollout, self._max_ahead = client, rollout, max_ahead
        self._ready: deque[tuple[int, Rollout]] = deque()
        self._done_with = 0  # batches the trainer trained and pushed, or dropped
        self._needed = num_steps
        self._failed: tuple[int, BaseException] | None = None
        self._stop = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._produce, name="arctic-rl-rollouts", daemon=True)

    def __enter__(self) -> "_Producer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._changed:
            self._stop = True
            self._changed.notify_all()
        self._thread.join()  # a rollout in flight finishes first (its calls have timeouts)

    def _may_start(self, index: int) -> bool:
        return self._stop or (index < self._needed and index <= self._done_with + self._max_ahead)

    def _produce(self) -> None:
        index = 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._may_start(index))
                if self._stop:
                    return
            try:
                item = self._rollout(self._client, index)
                if not isinstance(item, Rollout):
                    raise TypeError(f"the rollout function returned {type(item).__name__}, not a Rollout")
            except BaseException as e:  # handed to the trainer, which raises it
                with self._changed:
                    self._failed = (index, e)
                    self._changed.notify_all()
                return
            with self._changed:
                self._ready.append((index, item))
                self._changed.notify_all()
            index += 1

    def next(self) -> tuple[int, Rollout]:
        """The oldest batch made and not yet taken (waits for it); the rollout's error if it failed."""
        with self._changed:
            self._changed.wait_for(lambda: self._ready or self._failed is not None)
            if self._ready:
                return self._ready.popleft()
            index, error = self._failed
        raise RuntimeError(f"the rollout of batch {index} failed: {error}") from error

    def done_with(self, dropped: bool) -> None:
        with self._changed:
            self._done_with += 1
            self._needed += dropped  # a dropped batch is replaced
            self._changed.notify_all()
