"""Multi-turn rollouts: the policy and an environment (``environment.py``) take turns until the episode ends.

Each turn, every live episode is generated in one ``engine.generate`` call (``n=1`` per episode, the episode's
own seed for the turn: ``mix_seed(sample_seed(prompt seed, sample), turn)``, ``engines/seeds.py``), up to a stop token
of the environment or EOS. A turn ending at a stop token goes to ``env.step`` (under a time limit); its
observation ids are appended to the context and to the response with loss mask 0. The episode ends when:

- the policy ends its turn with EOS (or any token but a stop token): ``answer``;
- the environment says ``done``: ``done``;
- ``max_turns`` turns were generated: ``max_turns``;
- the response (generated and observation tokens) reaches ``sampling.max_response_length``: ``response_budget``
  (truncated: a turn cut at the budget, an observation that does not fit in what is left (not appended), or no
  budget left for an answer);
- a fault: the step raised (``error``), ran past ``step_timeout_s`` (``timeout``), returned an observation longer
  than ``max_observation_tokens`` (``observation_budget``), or something that is not a ``StepResult`` of token
  ids of the vocabulary (``0 <= id < vocab_size``) and a finite reward, or raised ``BadOutput`` (``bad_output``).
  The episode ends there with reward ``fault_reward``, a warning is logged, and the fault is counted
  (``multi_turn/fault_<kind>``); the run goes on.

With a time limit, each ``env.step`` runs on a daemon thread of its own while the loop waits at most
``step_timeout_s``, so the limit holds whatever the tool does with exceptions; a step past it is abandoned (a
thread cannot be stopped: it runs until its tool returns) and counted while it runs (``multi_turn/abandoned_steps``,
a warning each time the count grows). A ``reset`` that raises or returns no tokens of the vocabulary stops the run
with a ``ConfigError`` naming the environment class and the sample.

The response is exactly the concatenation of the turns' generated ids and the observations' ids (token-in /
token-out: nothing is decoded and re-encoded); the sampler's log-prob of each generated token is kept, 0.0 on
the environment's. Rewards: the environment's step rewards summed, as the named reward ``environment``; when
the module overrides ``reward`` its rewards are added (``rewards.py`` mixes them), except on a faulted episode.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
from collections import Counter
from dataclasses import dataclass, field, fields
from numbers import Integral
from typing import Any

from arctic_rl.errors import ConfigError
from arctic_rl.options.rollout import EnvironmentOptions, environment_class  # the options, here under their former path too
from arctic_rl.rollout.engines.base import Completion, RolloutEngine, SamplingConfig
from arctic_rl.rollout.engines.seeds import mix_seed, resolve_prompt_seeds, sample_seed
from arctic_rl.rollout.environment import BadOutput, Environment, StepResult
from arctic_rl.rollout.time_limit import CallTimedOut, call_on_thread

log = logging.getLogger(__name__)

FAULTS = ("error", "timeout", "observation_budget", "bad_output")
ENDS = ("answer", "done", "max_turns", "response_budget") + FAULTS
ENVIRONMENT = "environment"  # the name of the environment's reward among the named rewards


def make_environment(options: EnvironmentOptions, tokenizer) -> Environment:
    """A fresh environment for one episode: ``options.env_class(tokenizer=..., **options.env_args)``."""
    return environment_class(options.env_class)(tokenizer=tokenizer, **options.env_args)


def check_environment(module) -> None:
    """Before any engine starts: a module with ``rollout.environment`` can make its environment (the class takes the
    tokenizer and ``env_args``; a ``ToolEnvironment``'s stop string is one token) and fits its turns in the response."""
    options = module.options.rollout.environment
    if options is None:
        return
    try:
        env = make_environment(options, module.tokenizer)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"model.rollout.environment: {options.env_class}(tokenizer=..., **env_args) raised"
                          f" {type(e).__name__}: {e}") from e
    stops = getattr(env, "stop_token_ids", None)
    if stops is None or any(isinstance(t, bool) or not isinstance(t, int) for t in stops):
        raise ConfigError(f"model.rollout.environment: {options.env_class} must have stop_token_ids, a tuple of token ids,"
                          f" got {stops!r}")


class AbandonedSteps:
    """The ``env.step`` threads of this process left running past ``step_timeout_s`` (each runs until its tool
    returns), and the count last warned about."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.warned_at = 0
        self.lock = threading.Lock()

    def add(self, thread: threading.Thread) -> None:
        with self.lock:
            self.threads.append(thread)

    def running(self) -> int:
        """How many are still running; a warning when that is more than ever before."""
        with self.lock:
            self.threads = [t for t in self.threads if t.is_alive()]
            running, grew = len(self.threads), len(self.threads) > self.warned_at
            self.warned_at = max(self.warned_at, running)
        if grew:
            log.warning("multi-turn: %d environment steps that ran past step_timeout_s are still running on abandoned daemon"
                        " threads (a thread cannot be stopped: each runs until its tool returns, holding what it holds); make"
                        " the tools return (their own timeouts) or raise step_timeout_s", running)
        return running


ABANDONED = AbandonedSteps()


@dataclass
class Episode:
    """One sample's episode as it runs."""

    env: Environment | None  # None once ended in the rollout stream, or until a resumed stream replays it
    context: list[int]  # prompt + response so far: grows only by appending
    seed: int | None
    prompt_length: int
    logprobs: list[float] = field(default_factory=list)  # per response token (0.0 on observations)
    loss_mask: list[float] = field(default_factory=list)  # per response token: 1.0 generated, 0.0 observation
    turns: int = 0
    reward: float = 0.0
    end: str | None = None  # one of ENDS once ended
    detail: str = ""
    truncated: bool = False
    infos: list[dict] = field(default_factory=list)

    @property
    def response(self) -> list[int]:
        return self.context[self.prompt_length:]

    def state(self) -> dict[str, Any]:
        """Everything but the environment, as plain lists and numbers (a paused episode in a checkpoint)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "env"}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Episode:
        """The episode :meth:`state` saved, without its environment."""
        return cls(env=None, **state)

    def finish(self, end: str, detail: str = "", truncated: bool = False) -> None:
        self.end, self.detail, self.truncated = end, detail, truncated

    def completion(self, fault_reward: float) -> Completion:
        faulted = self.end in FAULTS
        record = {"turns": self.turns, "end": self.end, "detail": self.detail, "faulted": faulted, "truncated": self.truncated,
                  "environment_reward": fault_reward if faulted else self.reward, "observation_tokens": int(
                      len(self.loss_mask) - sum(self.loss_mask)), "infos": self.infos}
        return Completion(self.response, list(self.logprobs), "length" if self.truncated else "stop", list(self.loss_mask), record)


def run_episodes(engine: RolloutEngine, options: EnvironmentOptions, tokenizer, rows: list[dict[str, Any]], group_size: int,
                 sampling: SamplingConfig, vocab_size: int) -> list[Completion]:
    """``group_size`` episodes of each of ``rows`` (dataset rows with ``prompt_token_ids``), samples of a row
    contiguous; ``sampling`` gives the response budget (``max_tokens``), temperature, top-p and seeds (per row);
    ``vocab_size``: the policy's (its model's embedding rows), which every token id must be below.
    Returns one :class:`Completion` per episode with its ``loss_mask`` and ``episode`` record."""
    row_seeds = resolve_prompt_seeds(sampling.seed, sampling.prompt_seeds, len(rows))
    episodes: list[Episode] = []
    for i, row in enumerate(rows):
        for k in range(group_size):
            env, context = start_episode(options, tokenizer, row, f"sample {k} of prompt {i} of the batch", vocab_size)
            seed = None if row_seeds is None else sample_seed(row_seeds[i], k)
            episodes.append(Episode(env, context, seed, len(context)))
    stop_ids = tuple(episodes[0].env.stop_token_ids) if episodes else ()
    if any(tuple(e.env.stop_token_ids) != stop_ids for e in episodes):
        raise ConfigError("model.rollout.environment: every episode's environment must stop on the same stop_token_ids")
    budget = sampling.max_tokens
    rules = EpisodeRules(options, tokenizer, stop_ids, tokenizer.eos_token_id, vocab_size)
    for turn in range(options.max_turns):
        live = [e for e in episodes if e.end is None]
        if not live:
            break
        seeds = None if row_seeds is None else tuple(mix_seed(e.seed, turn) for e in live)
        remaining = [budget - len(e.response) for e in live]
        turn_sampling = SamplingConfig(n=1, max_tokens=max(remaining), temperature=sampling.temperature, top_p=sampling.top_p,
                                       prompt_seeds=seeds, stop_token_ids=stop_ids)
        outputs = engine.generate([list(e.context) for e in live], turn_sampling)
        for e, left, out in zip(live, remaining, outputs):
            _take_turn(e, out[0], left, rules, turn)
    for e in episodes:
        if e.end is None:
            e.finish("max_turns")
    abandoned = ABANDONED.running()
    warn_faults(episodes, options.fault_reward)
    completions = [e.completion(options.fault_reward) for e in episodes]
    for c in completions:
        c.episode["abandoned_steps"] = abandoned
    return completions


def warn_faults(episodes: list[Episode], fault_reward: float, which: str = "episodes") -> None:
    """One warning for those of ``episodes`` that a fault ended (none: no warning): the count of each kind and the
    first one's reason."""
    faults = Counter(e.end for e in episodes if e.end in FAULTS)
    if faults:
        first = next(e for e in episodes if e.end in FAULTS)
        log.warning("multi-turn: %d of %d %s ended by a fault %s (reward %g); first: %s: %s", sum(faults.values()),
                    len(episodes), which, dict(faults), fault_reward, first.end, first.detail)


def start_episode(options: EnvironmentOptions, tokenizer, row: dict[str, Any], which: str, vocab_size: int) -> tuple[Environment, list[int]]:
    """A fresh environment for the episode of dataset row ``row`` and its first context; a ``ConfigError`` naming the
    class and the sample (``which``: say "sample 2 of prompt 0 of the batch") when making it or its ``reset`` raises,
    or ``reset`` returns no token ids of the vocabulary."""
    where = f"model.rollout.environment: {options.env_class.rpartition('.')[2]}"
    sample = f"on {which} ({str(row.get('prompt'))[:80]!r})"
    try:
        env = make_environment(options, tokenizer)
    except Exception as e:  # noqa: BLE001  (reported as one line naming the sample)
        raise ConfigError(f"{where}(tokenizer=..., **env_args) raised {type(e).__name__}: {e} {sample}") from e
    where = f"model.rollout.environment: {type(env).__name__}.reset"
    try:
        context = list(env.reset(dict(row)))
    except Exception as e:  # noqa: BLE001  (the environment's own bug: one line, no traceback)
        raise ConfigError(f"{where} raised {type(e).__name__}: {e} {sample}; fix the environment or the row") from e
    bad = next((t for t in context if isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < vocab_size), None)
    if not context or bad is not None:
        got = "no tokens" if not context else f"{bad!r}, not a token id in [0, {vocab_size})"
        raise ConfigError(f"{where} returned {got} {sample}; it must return the first context as token ids")
    return env, [int(t) for t in context]


@dataclass(frozen=True)
class EpisodeRules:
    """What a turn's end is checked against: the environment options, the tokenizer (a turn's text for ``step``),
    the stop token ids every episode's environment shares, EOS and the policy's vocabulary size."""

    options: EnvironmentOptions
    tokenizer: Any
    stop_ids: tuple[int, ...]
    eos: int | None
    vocab_size: int


def _take_turn(e: Episode, out: Completion, left: int, rules: EpisodeRules, turn: int) -> None:
    """Append one generated turn to ``e`` and, when it ends at a stop token, the environment's answer."""
    ids, logprobs = list(out.token_ids[:left]), list(out.logprobs[:left])
    cut = len(out.token_ids) > left or out.finish_reason == "length"
    e.context.extend(ids)
    e.logprobs.extend(logprobs)
    e.loss_mask.extend([1.0] * len(ids))
    end_turn(e, ids, cut, left - len(ids), rules, turn)


def end_turn(e: Episode, ids: list[int], cut: bool, left_after: int, rules: EpisodeRules, turn: int) -> None:
    """End turn ``turn`` of ``e``, whose generated ``ids`` are already appended to it: count it, and end the episode
    (``cut``: the turn reached the response budget; an answer; a fault) or append the environment's answer to a call
    (``left_after``: the response budget left after the turn)."""
    options, tokenizer, stop_ids, eos, vocab_size = rules.options, rules.tokenizer, rules.stop_ids, rules.eos, rules.vocab_size
    e.turns += 1
    if cut:
        e.finish("response_budget", f"turn {turn} reached the response budget", truncated=True)
        return
    if not ids or ids[-1] == eos or ids[-1] not in stop_ids:
        e.finish("answer")
        return
    if left_after == 0:
        e.finish("response_budget", f"turn {turn} called a tool with no response budget left for its answer", truncated=True)
        return
    text = tokenizer.decode(ids, skip_special_tokens=False)  # for the environment's parser only
    try:
        if options.step_timeout_s is None:
            result = e.env.step(ids, text)
        else:
            result = call_on_thread(lambda: e.env.step(ids, text), options.step_timeout_s, "arctic-rl-env-step")
    except CallTimedOut as err:
        ABANDONED.add(err.thread)
        e.finish("timeout", f"step {turn} still running after {options.step_timeout_s:g} s (abandoned, left running)")
        return
    except BadOutput as err:
        e.finish("bad_output", f"step {turn}: {err}")
        return
    except Exception as err:  # noqa: BLE001  (a tool's fault ends its episode, not the run)
        e.finish("error", f"step {turn} raised {type(err).__name__}: {err}")
        return
    problem = _bad_result(result, vocab_size)
    if problem:
        e.finish("bad_output", f"step {turn} {problem}")
        return
    obs = [int(t) for t in result.observation_ids]
    if len(obs) > options.max_observation_tokens:
        e.finish("observation_budget", f"step {turn} returned {len(obs)} observation tokens, over"
                 f" max_observation_tokens={options.max_observation_tokens}")
        return
    if len(obs) > left_after:
        e.finish("response_budget", f"step {turn}'s observation ({len(obs)} tokens) is over the response budget left"
                 f" ({left_after})", truncated=True)
        return
    e.context.extend(obs)
    e.logprobs.extend([0.0] * len(obs))
    e.loss_mask.extend([0.0] * len(obs))
    e.reward += float(result.reward)
    e.infos.append(dict(result.info))
    if result.done:
        e.finish("done")
    elif e.turns >= options.max_turns:
        e.finish("max_turns")
    elif len(obs) == left_after:
        e.finish("response_budget", "no response budget left after the observation", truncated=True)


def _bad_result(result: Any, vocab_size: int) -> str:
    """Why ``result`` is not a usable ``StepResult`` ("" when it is)."""
    if not isinstance(result, StepResult):
        return f"returned {type(result).__name__}, not a StepResult"
    try:
        ids = list(result.observation_ids)
    except TypeError:
        return f"returned observation_ids of type {type(result.observation_ids).__name__}, not a list of token ids"
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"returned observation id {bad!r}, not a token id of the vocabulary (an int in [0, {vocab_size}))"
    if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)) or not math.isfinite(result.reward):
        return f"returned reward {result.reward!r}, not a finite number"
    return ""


def multi_turn_metrics(completions: list[Completion]) -> dict[str, float]:
    """``multi_turn/*`` of a batch's episodes (empty for single-turn completions): turn and token means, the
    environment's reward, the fraction ending each way (``end_<reason>_frac``) and the count of each fault
    (``fault_<kind>``, every kind logged, 0 included), and the steps past their time limit still running in this
    process (``abandoned_steps``)."""
    episodes = [c.episode for c in completions if c.episode is not None]
    if not episodes:
        return {}
    n = len(episodes)
    ends = Counter(ep["end"] for ep in episodes)
    metrics = {
        "multi_turn/turns_mean": sum(ep["turns"] for ep in episodes) / n,
        "multi_turn/observation_tokens_mean": sum(ep["observation_tokens"] for ep in episodes) / n,
        "multi_turn/environment_reward_mean": sum(ep["environment_reward"] for ep in episodes) / n,
        "multi_turn/fault_frac": sum(ends[f] for f in FAULTS) / n,
        "multi_turn/abandoned_steps": float(max(ep["abandoned_steps"] for ep in episodes)),
    }
    metrics.update({f"multi_turn/end_{end}_frac": ends[end] / n for end in ENDS if end not in FAULTS})
    metrics.update({f"multi_turn/fault_{kind}": float(ends[kind]) for kind in FAULTS})
    return metrics
