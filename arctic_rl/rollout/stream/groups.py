"""The rollout stream's units and its one engine call.

A :class:`StreamGroup` is one prompt and its ``G`` samples. A :class:`StreamSample` grows by segments: each
segment is one engine call of at most the stream's token budget, sampled from the weights the engine held then,
and every token keeps that version (the trainer's global step whose weights sampled it) and its sampler
log-prob. A sample the budget cut is *paused*; the next segment continues it as a new request whose prompt is the
prompt plus the tokens so far, so its KV is recomputed under the newer weights.

:func:`extend_groups` is one round: every unfinished sample of the given groups, in one ``engine.generate`` call
of ``n = 1`` requests. Segment ``s`` of sample ``k`` of a group (restarted ``attempt`` times) samples from the
seed ``mix_seed(prompt seed, attempt, k, s)``: a resumed run continues a paused sample exactly as the
uninterrupted run does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from arctic_rl.data.prompts import PROMPT_IDS
from arctic_rl.rollout.engines.base import Completion, RolloutEngine, SamplingConfig
from arctic_rl.rollout.engines.seeds import mix_seed
from arctic_rl.rollout.multi_turn import ABANDONED, Episode


@dataclass
class StreamSample:
    """One sample, possibly paused (``finish_reason`` None)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # per token: the sampler's log-prob, at sampling time
    versions: list[int] = field(default_factory=list)  # per token: the global step of the weights that sampled it
    finish_reason: str | None = None  # "stop" or "length"; None while unfinished
    segments: int = 0  # engine calls that extended it
    # a multi-turn episode's (``episodes.py``; None and unused in a single-turn stream):
    episode: Episode | None = None  # its context, loss mask, turns and environment; token_ids/logprobs mirror its response
    turn_start: int = 0  # where in the response the turn being generated starts
    turn_segments: int = 0  # segments of that turn so far (a turn paused at the budget spans several)
    tool_turns: list[list[int]] = field(default_factory=list)  # per env.step answered: [turn start, turn end, observation end]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def state(self) -> dict[str, Any]:
        """Plain lists and numbers (the episode's environment is not saved: a resumed stream replays it)."""
        plain = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "episode"}
        return {**plain, "episode": None if self.episode is None else self.episode.state()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> StreamSample:
        episode = state.get("episode")  # None in a single-turn stream (and in checkpoints from before episodes)
        return cls(**{**state, "episode": None if episode is None else Episode.from_state(episode)})


@dataclass
class StreamGroup:
    """A prompt of the stream and its samples (empty until its first round)."""

    uid: str  # "<step>/<slot>": the step whose batch brought the prompt in, its slot in that global batch; sample k is "<uid>#k"
    row: dict[str, Any]  # the loader's row: prompt, prompt_token_ids and the dataset's other columns
    prompt_seed: int | None  # None: unseeded sampling (the engine's own random state)
    samples: list[StreamSample] = field(default_factory=list)
    attempt: int = 0  # times restarted from its prompt (past the staleness bound, ``stale_groups: regenerate``)

    @property
    def complete(self) -> bool:
        return bool(self.samples) and all(s.done for s in self.samples)

    @property
    def oldest_version(self) -> int | None:
        """The oldest weights behind any of its tokens (None before its first token)."""
        firsts = [s.versions[0] for s in self.samples if s.versions]
        return min(firsts) if firsts else None

    def restart(self) -> None:
        self.samples, self.attempt = [], self.attempt + 1

    def completions(self, fault_reward: float = 0.0) -> list[Completion]:
        """The finished samples as engine completions (``weight_version``: the newest weights in each); an episode's
        with its loss mask and record (``fault_reward``: a faulted episode's environment reward)."""
        out = []
        abandoned = ABANDONED.running() if any(s.episode is not None for s in self.samples) else 0
        for s in self.samples:
            if s.episode is None:
                out.append(Completion(list(s.token_ids), list(s.logprobs), s.finish_reason or "length"))
            else:
                out.append(s.episode.completion(fault_reward))
                out[-1].episode["abandoned_steps"] = abandoned  # the env.step threads past their limit still running
            out[-1].weight_version = max(s.versions, default=None)
        return out

    def state(self) -> dict[str, Any]:
        """Plain lists and numbers (a checkpoint loads it with ``weights_only``)."""
        plain = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "samples"}
        return {**plain, "samples": [s.state() for s in self.samples]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> StreamGroup:
        return cls(**{**state, "samples": [StreamSample.from_state(s) for s in state["samples"]]})


@dataclass(frozen=True)
class SegmentSampling:
    """How the stream samples: the module's sampling options and the stream's budget per segment."""

    group_size: int
    max_tokens: int  # a sample's whole length limit (``sampling.max_response_length``)
    budget: int  # tokens per segment (``partial_rollout_tokens``)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


def extend_groups(engine: RolloutEngine, groups: list[StreamGroup], sampling: SegmentSampling, version: int,
                  step_of: dict[int, int] | None = None) -> int:
    """One round: extend every unfinished sample of ``groups`` by a segment of at most ``sampling.budget`` tokens,
    sampled by the engine holding the weights of global step ``version``; with ``step_of`` (in-flight weight updates)
    each token's version is the global step of the engine version that sampled it (``Completion.token_versions``). A sample that reaches ``max_tokens`` ends
    as "length" (tokens past it are cut, as the engine's own limit would); one the budget cut stays paused.
    Returns the tokens added."""
    work: list[tuple[StreamGroup, int, StreamSample]] = []
    for group in groups:
        if not group.samples:
            group.samples = [StreamSample() for _ in range(sampling.group_size)]
        work += [(group, k, s) for k, s in enumerate(group.samples) if not s.done]
    if not work:
        return 0
    room = [sampling.max_tokens - len(s.token_ids) for _, _, s in work]
    if min(room) <= 0:
        raise RuntimeError(f"sample {work[room.index(min(room))][0].uid} is unfinished at its length limit")
    seeded = all(g.prompt_seed is not None for g, _, _ in work)
    config = SamplingConfig(
        n=1, max_tokens=min(sampling.budget, max(room)), temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
        prompt_seeds=tuple(mix_seed(g.prompt_seed, g.attempt, k, s.segments) for g, k, s in work) if seeded else None,
    )
    outputs = engine.generate([list(g.row[PROMPT_IDS]) + s.token_ids for g, _, s in work], config)
    if len(outputs) != len(work) or any(len(o) != 1 for o in outputs):
        raise RuntimeError(f"engine returned {[len(o) for o in outputs]} completions for {len(work)} single-sample requests")
    added = 0
    for (group, _, sample), limit, (out,) in zip(work, room, outputs):
        tokens = out.token_ids[:limit]
        sample.token_ids += tokens
        sample.logprobs += out.logprobs[: len(tokens)]
        if step_of is not None:
            if out.token_versions is None:
                raise RuntimeError(f"{type(engine).__name__} returned no token versions for an in-flight round")
            sample.versions += [step_of[v] for v in out.token_versions[: len(tokens)]]
        else:
            sample.versions += [version] * len(tokens)
        sample.segments += 1
        added += len(tokens)
        if out.finish_reason == "stop" and len(out.token_ids) <= limit:
            sample.finish_reason = "stop"
        elif len(sample.token_ids) >= sampling.max_tokens:  # at the limit, or cut there
            sample.finish_reason = "length"
        elif not tokens:
            raise RuntimeError(f"engine returned no tokens for unfinished sample of {group.uid} (finish_reason {out.finish_reason!r})")
    return added
