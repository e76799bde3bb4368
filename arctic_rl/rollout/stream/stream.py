"""``RolloutStream``: asynchronous rollouts with partial samples and a staleness bound.

With ``RolloutCallback(max_staleness=k, partial_rollout_tokens=b)``, k >= 2, the engine generates in *rounds*: each
round extends every unfinished sample of the stream by at most ``b`` tokens (``groups.py``), in one engine call. A
step t runs as:

    on_train_batch_start(t): finish the round in flight; admit batch t's prompts (if the round before did not
                             already); take the first B complete groups within the bound (running catch-up rounds
                             while fewer are complete: the trainer waits); start the next round in a background
                             thread, with batch t+1's prompts admitted (Lightning's loader shows it ahead)
    training_step(t):        the update, concurrent with that round
    on_train_batch_end(t):   wait for the round (at most b tokens long), push the new weights

So no step waits for the longest sample: a long one is paused at the budget and continued by the next round, under
the newer weights, while the next batch's prompts start beside it. Groups complete out of order; the trainer takes
the oldest complete ones first and carries the rest forward (over-provisioning by construction).

**Staleness.** A token sampled by the weights of global step v and trained at step t is ``(t - v) // steps_per_batch``
rollout batches stale (the unit of ``rollout/staleness``). A group may be trained only while its oldest token is at
most k stale; a sample that finishes within one round is 1 stale, one continued over j more rounds j + 1, so the
budget lets a sample span k rounds. A group that can no longer be trained within the bound is restarted from its
prompt with the current weights (``stale_groups: regenerate``) or dropped and replaced by a fresh prompt drawn from
the training rows as dynamic sampling draws them (``drop``); the step logs how many.

**In-flight weight updates** (``in_flight=True``, an engine that ``UpdatesInFlight``): the step's new weights are
pushed while the round runs; the engine's decode loop pauses at its next step for them and goes on with the samples
it holds, so the trainer does not wait for the round to end. Each token then carries the version the engine reports
for it (mapped to the global step whose weights those were), so one segment may hold two versions.

**Dynamic sampling** (``model.rollout.dynamic_sampling``): a complete group whose rewards are all equal (no policy
gradient) is scored as it is taken, dropped, and replaced by one fresh prompt drawn as the stale ``drop`` policy
draws it, up to ``(max_num_gen_batches - 1) x`` the step's groups a step; past that, the step is completed with
dropped groups (zero advantage, ``dynamic_sampling/padded_groups``), as the synchronous path does.

**Multi-turn** (``model.rollout.environment``): each sample is an episode, extended by ``episodes.py`` a segment
of its current turn per round; a turn's end (the environment's answer appended) and the token budget are both pause
points, and a group is complete once all its episodes have ended.

**Resume.** The stream's state (every group admitted and not yet trained, with its paused samples, their tokens,
log-probs and versions, and each group's seed and restart count) is saved in the checkpoint. A resumed run trains on
each of those samples once, continuing a paused one from its saved tokens with the seeds the uninterrupted run uses (a paused episode's
environment is rebuilt by replaying its saved turns, ``episodes.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Literal

import torch

from arctic_rl.data.prompts import PROMPT_IDS
from arctic_rl.rollout.batch import ROLLOUT, ROLLOUT_METRICS, STREAM_GROUPS, RolloutBatch
from arctic_rl.rollout.engines.base import RolloutEngine, StopsAtDeadline, UpdatesInFlight
from arctic_rl.rollout.dynamic_sampling import informative
from arctic_rl.rollout.engines.seeds import global_slot, prompt_seeds
from arctic_rl.rollout.generation import build_rollout, score_groups
from arctic_rl.rollout.policy import RolloutPolicy
from arctic_rl.rollout.scored import ScoredGroups
from arctic_rl.rollout.stream.episodes import episode_rules, extend_episodes, restore_environments
from arctic_rl.rollout.stream.groups import SegmentSampling, StreamGroup, extend_groups

StaleGroups = Literal["regenerate", "drop"]
Refill = Callable[[int, int, int], dict[str, list]]  # (count, step, draw) -> a loader-like batch of fresh prompts


class StreamError(RuntimeError):
    """The stream's producer failed or went past its time limit."""


class RolloutStream:
    """The groups in flight, the rounds that extend them and the steps that take them (see the module docstring).

    Args:
        engine: what the rounds sample with (an in-process engine or a Ray pool).
        module: the policy module (tokenizer, rewards, advantages, sampling options).
        max_staleness: k >= 2 (rollout batches).
        budget: tokens per sample per round (``partial_rollout_tokens``).
        steps_per_batch: optimizer steps per rollout batch (the global step's unit).
        weights_step: global step of the weights the engine starts with.
        stale_groups: ``regenerate`` or ``drop`` (and replace through ``refill``).
        refill: fresh prompts for dropped groups (``drop`` only).
        rank, world_size: place a batch's prompts in the global batch (their seeds).
        behaviour_as_old: give a stale batch the sampler's log-probs as PPO's old policy (False: the trainer's
            mismatch correction takes them).
        round_timeout_s: the longest a step may wait for the rounds in flight before it fails with :class:`StreamError`.
        on_round: the context each round runs in (an in-process CUDA engine: its own stream, ``overlap.on_stream``).
        rounds_per_step: rounds generated beside each training step. None: as many as the step leaves time for (the
            engine kept busy; which weights sample which segment then depends on timing, so two runs differ).
        in_flight: new weights enter the engine while a round runs (the engine must be ``UpdatesInFlight``); call
            :meth:`before_sync` before each push instead of :meth:`finish`. Which token the weights reach first then
            depends on timing, so two runs differ.
        budget_s: a round also ends after this many seconds (``partial_rollout_seconds``; the engine must be
            ``StopsAtDeadline``): each sample keeps what it has (one token at least) and is continued next round.
            Where a round ends then depends on timing, so two runs differ.
    """

    def __init__(self, engine: RolloutEngine, module: RolloutPolicy, max_staleness: int, budget: int, steps_per_batch: int,
                 weights_step: int, stale_groups: StaleGroups = "regenerate", refill: Refill | None = None, rank: int = 0,
                 world_size: int = 1, behaviour_as_old: bool = True, round_timeout_s: float = 3600.0,
                 rounds_per_step: int | None = 1, on_round: Callable[[], AbstractContextManager] = nullcontext,
                 in_flight: bool = False, budget_s: float | None = None) -> None:
        if max_staleness < 2:
            raise ValueError(f"RolloutStream needs max_staleness >= 2 (a paused sample spans two rounds), got {max_staleness}")
        if budget < 1:
            raise ValueError(f"RolloutStream needs a budget of at least 1 token, got {budget}")
        if stale_groups == "drop" and refill is None:
            raise ValueError("stale_groups='drop' needs a refill of fresh prompts")
        self.dynamic = module.options.rollout.dynamic_sampling
        if self.dynamic is not None and refill is None:
            raise ValueError("dynamic sampling under the stream needs a refill of fresh prompts")
        hp = module.options.sampling
        self.sampling = SegmentSampling(module.group_size, hp.max_response_length, budget, hp.temperature, hp.top_p, hp.seed)
        environment = module.options.rollout.environment  # multi-turn: each sample an episode (``episodes.py``)
        self.rules = None if environment is None else episode_rules(module)
        self.fault_reward = 0.0 if environment is None else environment.fault_reward
        self.engine, self.module, self.max_staleness, self.steps_per_batch = engine, module, max_staleness, steps_per_batch
        self.weights_step, self.stale_groups, self.refill = weights_step, stale_groups, refill
        self.rank, self.world_size, self.behaviour_as_old, self.round_timeout_s = rank, world_size, behaviour_as_old, round_timeout_s
        if rounds_per_step is not None and rounds_per_step < 1:
            raise ValueError(f"RolloutStream needs rounds_per_step >= 1 or None, got {rounds_per_step}")
        self.rounds_per_step, self.on_round = rounds_per_step, on_round
        if in_flight and not isinstance(engine, UpdatesInFlight):
            raise ValueError(f"in-flight weight updates need an engine that takes weights while it decodes (transformers or"
                             f" vLLM, in process or as Ray replicas); {type(engine).__name__} does not")
        if budget_s is not None and (not budget_s > 0 or not isinstance(engine, StopsAtDeadline)):
            raise ValueError(f"a round's budget in seconds must be > 0 and needs an engine that can stop at a deadline"
                             f" (transformers or vLLM, in process or as Ray replicas); got {budget_s!r} with {type(engine).__name__}")
        self.budget_s = budget_s
        # in flight: the engine's weight versions (0 its start-up weights, +1 per update) -> the global step of those weights
        self.step_of: dict[int, int] | None = {engine.weight_version: weights_step} if in_flight else None
        self.groups: list[StreamGroup] = []  # admitted, not yet trained, in admission order
        self.admitted_step = -1  # the last step whose loader batch was admitted
        self.draws = 0  # refill draws so far (each draw's prompts are fixed by it)
        self.counts = {"regenerated_groups": 0, "dropped_groups": 0}  # since the last take
        self._scored: dict[str, ScoredGroups] = {}  # dynamic sampling: complete groups' rewards, by uid (not saved: recomputed)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arctic-rl-stream")
        self._round: Future | None = None
        self._stop = threading.Event()
        self.last_rounds = 0  # rounds the last launch ran
        self._wait_s = self._engine_busy_s = self._busy_since_pop = 0.0  # trainer waits; engine time for the next batch; since pop_timing
        self._popped_at = time.perf_counter()

    # ------------------------------------------------------------------ admission
    def admit(self, batch: dict[str, list], step: int) -> None:
        """The prompts of the loader batch Lightning hands over at ``step`` join the stream (once per step)."""
        if step <= self.admitted_step:
            return
        self._add(batch, step, str(step), 0)
        self.admitted_step = step

    def _add(self, batch: dict[str, list], step: int, tag: str, seed_round: int) -> None:
        count = len(batch[PROMPT_IDS])
        seed = self.sampling.seed
        seeds = [None] * count if seed is None else prompt_seeds(seed, step, count, self.rank, self.world_size, seed_round)
        for i in range(count):
            row = {k: v[i] for k, v in batch.items() if k not in (ROLLOUT, ROLLOUT_METRICS, STREAM_GROUPS)}
            self.groups.append(StreamGroup(f"{tag}/{global_slot(i, self.rank, self.world_size)}", row, seeds[i]))

    # ------------------------------------------------------------------ rounds
    def staleness(self, step: int, version: int) -> int:
        return (step - version) // self.steps_per_batch

    def _expire(self, train_step: int, candidates: list[StreamGroup]) -> None:
        """Restart or drop each of ``candidates`` that could no longer be trained within the bound at ``train_step``."""
        for group in candidates:
            oldest = group.oldest_version
            if oldest is None or self.staleness(train_step, oldest) <= self.max_staleness:
                continue
            self._scored.pop(group.uid, None)  # its samples are about to go
            if self.stale_groups == "regenerate":
                group.restart()
                self.counts["regenerated_groups"] += 1
            else:
                self.groups.remove(group)
                self.counts["dropped_groups"] += 1
                self.draws += 1
                self._add(self.refill(1, train_step, self.draws), train_step, f"{train_step}r{self.draws}", 1_000_000 + self.draws)

    def _run_round(self, train_step: int) -> int:
        """Extend every unfinished group once (their output is trained at ``train_step`` at the earliest)."""
        started = time.perf_counter()
        self._expire(train_step, [g for g in self.groups if not g.complete])
        if self.budget_s is not None:
            self.engine.stop_at(time.monotonic() + self.budget_s)
        try:
            with self.on_round():
                unfinished = [g for g in self.groups if not g.complete]
                if self.rules is None:
                    added = extend_groups(self.engine, unfinished, self.sampling, self.weights_step, self.step_of)
                else:
                    added = extend_episodes(self.engine, unfinished, self.sampling, self.rules, self.weights_step, self.step_of)
        finally:
            if self.budget_s is not None:
                self.engine.stop_at(None)
        busy = time.perf_counter() - started
        self._engine_busy_s += busy
        self._busy_since_pop += busy
        return added

    def launch(self, upcoming: list[tuple[dict[str, list], int]], train_step: int) -> None:
        """Admit the ``upcoming`` loader batches (each with the step Lightning hands it over at; the data's end cuts
        the list short) and start generating in the background, output trained at ``train_step`` at the earliest:
        ``rounds_per_step`` rounds, or (None) rounds until :meth:`finish` asks it to stop or nothing is left unfinished."""
        if self._round is not None:
            raise RuntimeError("a stream round is still in flight")
        for batch, step in upcoming:
            self.admit(batch, step)
        self._stop.clear()
        self._round = self._executor.submit(self._run_rounds, train_step)

    def _run_rounds(self, train_step: int) -> int:
        rounds = 0
        while True:
            self._run_round(train_step)
            rounds += 1
            if self._stop.is_set() or rounds == self.rounds_per_step or all(g.complete for g in self.groups):
                return rounds

    def finish(self) -> None:
        """Wait for the round in flight (before the engine takes new weights); its error, if any, is raised here."""
        if self._round is None:
            return
        self._stop.set()  # the round running ends at its budget; no other starts
        round_, self._round = self._round, None
        started = time.perf_counter()
        try:
            self.last_rounds = round_.result(timeout=self.round_timeout_s)
        except FutureTimeout:
            raise StreamError(f"a rollout stream round ran past round_timeout_s={self.round_timeout_s:g} s: the engine is stuck"
                              " or far slower than expected") from None
        except Exception as e:
            raise StreamError(f"the rollout stream's round failed: {type(e).__name__}: {e}") from e
        finally:
            self._wait_s += time.perf_counter() - started

    def before_sync(self, global_step: int) -> None:
        """In flight: the weights about to be pushed are global step ``global_step``'s (before the push, so a round
        that samples with them can tell)."""
        if self.step_of is not None:
            self.step_of[self.engine.weight_version + 1] = global_step

    def synced(self, global_step: int) -> None:
        self.weights_step = global_step

    # ------------------------------------------------------------------ taking a step's groups
    def take(self, count: int, step: int) -> tuple[RolloutBatch, dict[str, float], list[str]]:
        """The ``count`` oldest complete groups that ``step`` may train on (catch-up rounds first while fewer are
        complete; with dynamic sampling, informative ones). Returns their rollout batch, metrics, and the ids of the
        groups taken."""
        self.finish()
        started = time.perf_counter()
        filtered: list[StreamGroup] = []  # dynamic sampling: the equal-reward groups dropped by this take, in order
        refills = 0 if self.dynamic is None else (self.dynamic.max_num_gen_batches - 1) * count
        while True:
            self._expire(step, [g for g in self.groups if g.complete])
            ready = [g for g in self.groups if g.complete]
            if self.dynamic is not None:
                ready, refills = self._informative(ready, step, filtered, refills)
            if len(ready) >= count:
                break
            if not any(not g.complete for g in self.groups):
                if len(ready) + len(filtered) >= count:  # out of fresh prompts: complete the step with dropped groups
                    break
                raise StreamError(f"step {step} needs {count} groups and the stream holds {len(ready)} complete and none in flight")
            self._run_round(step)
        self._wait_s += time.perf_counter() - started
        taken = ready[:count]
        for group in taken:
            self.groups.remove(group)
        padding = filtered[: count - len(taken)]
        rollout, metrics = self._rollout(taken + padding, step)
        if self.dynamic is not None:
            scored = len(taken) + len(filtered)
            metrics.update({"dynamic_sampling/dropped_groups": float(len(filtered)),
                            "dynamic_sampling/padded_groups": float(len(padding)),
                            "dynamic_sampling/informative_frac": len(taken) / max(scored, 1)})
        return rollout, metrics, [g.uid for g in taken + padding]

    def _informative(self, ready: list[StreamGroup], step: int, filtered: list[StreamGroup],
                     refills: int) -> tuple[list[StreamGroup], int]:
        """Dynamic sampling: score the ``ready`` groups not yet scored; move those whose rewards are all equal from the
        stream to ``filtered``, each replaced by a fresh prompt while ``refills`` lasts. Returns the informative ones
        and the refills left."""
        new = [g for g in ready if g.uid not in self._scored]
        if new:
            scored = self._score(new)
            for i, group in enumerate(new):
                self._scored[group.uid] = scored.take_groups([i])
        kept = []
        for group in ready:
            if informative(self._scored[group.uid].rewards, self.sampling.group_size)[0]:
                kept.append(group)
                continue
            self.groups.remove(group)
            filtered.append(group)
            if refills > 0:
                refills -= 1
                self.draws += 1
                self._add(self.refill(1, step, self.draws), step, f"{step}r{self.draws}", 1_000_000 + self.draws)
        return kept, refills

    def _score(self, groups: list[StreamGroup]) -> ScoredGroups:
        batch = {k: [group.row[k] for group in groups] for k in groups[0].row}
        return score_groups(self.module, batch, [c for group in groups for c in group.completions(self.fault_reward)], self.sampling.group_size)

    def _rollout(self, taken: list[StreamGroup], step: int) -> tuple[RolloutBatch, dict[str, float]]:
        if all(group.uid in self._scored for group in taken):  # dynamic sampling scored them already
            scored = ScoredGroups.concat([self._scored.pop(group.uid) for group in taken])
        else:
            scored = self._score(taken)
        self._scored = {uid: part for uid, part in self._scored.items() if any(g.uid == uid for g in self.groups)}
        rollout, metrics = build_rollout(self.module, scored, self._engine_busy_s)
        samples = [s for group in taken for s in group.samples]
        versions = torch.zeros_like(rollout.response_ids)
        for i, s in enumerate(samples):
            versions[i, : len(s.versions)] = torch.tensor(s.versions, dtype=torch.long)
        rollout.token_versions = versions
        stale = torch.div(step - versions, self.steps_per_batch, rounding_mode="floor")[rollout.response_mask > 0]
        if self.behaviour_as_old and bool((stale > 0).any()):  # PPO's old policy: the behaviour policy that sampled each token
            rollout.old_logprobs = rollout.sampler_logprobs.clone()
        tokens = max(stale.numel(), 1)
        partial = sum(len(s.token_ids) for s in samples if s.segments > 1)
        metrics.update({
            "rollout/staleness": float(stale.max()) if stale.numel() else 0.0,
            "stream/staleness_mean": stale.float().mean().item() if stale.numel() else 0.0,
            **{f"stream/staleness_frac_{j}": (stale == j).sum().item() / tokens for j in range(self.max_staleness + 1)},
            "stream/partial_token_frac": partial / max(sum(len(s.token_ids) for s in samples), 1),
            "stream/partial_sample_frac": sum(s.segments > 1 for s in samples) / len(samples),
            "stream/buffered_groups": float(sum(gr.complete for gr in self.groups)),
            "stream/in_flight_groups": float(sum(not gr.complete for gr in self.groups)),
            **{f"stream/{k}": float(v) for k, v in self.counts.items()},
        })
        self.counts = dict.fromkeys(self.counts, 0)
        self._engine_busy_s = 0.0
        return rollout, metrics

    def pop_timing(self) -> dict[str, float]:
        """The trainer's wait for rollouts and the engine's idle time since the last call (``timing/*``)."""
        now = time.perf_counter()
        idle = max(now - self._popped_at - self._busy_since_pop, 0.0)
        wait, self._wait_s, self._busy_since_pop, self._popped_at = self._wait_s, 0.0, 0.0, now
        return {"timing/rollout_wait_s": wait, "timing/engine_idle_s": idle}

    # ------------------------------------------------------------------ lifecycle and checkpoints
    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._round = None

    def state_dict(self) -> dict[str, Any]:
        """Every group not yet trained (a round in flight is finished first), as plain lists and numbers."""
        self.finish()
        return {"groups": [g.state() for g in self.groups], "admitted_step": self.admitted_step, "draws": self.draws,
                "weights_step": self.weights_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.groups = [StreamGroup.from_state(g) for g in state["groups"]]
        self.admitted_step, self.draws = state["admitted_step"], state["draws"]
        if self.rules is not None:  # paused episodes get their environments back (replayed); a failed replay restarts its group
            self.counts["regenerated_groups"] += len(restore_environments(self.groups, self.rules))
