"""The ``rollout`` option section (``model.init_args.rollout``: from completions to advantages) and what it composes:
DAPO's overlong buffer and dynamic sampling, and the multi-turn environment (the code that runs them is
``rollout/rewards.py``, ``rollout/dynamic_sampling.py`` and ``rollout/multi_turn.py``)."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Literal

from arctic_rl.errors import ConfigError, check_number

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo"]
RewardScaling = Literal["group", "batch", "none"]
RewardAggregation = Literal["sum_then_normalize", "normalize_then_sum"]


@dataclass(frozen=True)
class OverlongBuffer:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13; verl's
    ``reward_model.overlong_buffer``). With ``L = max_response_length``, a completion of ``|y|`` tokens
    longer than ``L - len`` gets ``-penalty_factor * min((|y| - (L - len)) / len, 1)`` added to its reward.

    Args:
        len: the buffer, in tokens, before the length limit where the penalty grows from 0 to ``-penalty_factor``.
        penalty_factor: the penalty at the limit.
    """

    len: int
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.len < 1:
            raise ConfigError(f"model.rollout.overlong_buffer.len must be >= 1 token, got {self.len}")
        if not (math.isfinite(self.penalty_factor) and self.penalty_factor >= 0):
            raise ConfigError(f"model.rollout.overlong_buffer.penalty_factor must be a finite number >= 0, got {self.penalty_factor}")


@dataclass(frozen=True)
class DynamicSampling:
    """DAPO's dynamic sampling (``model.rollout.dynamic_sampling``; ``rollout/dynamic_sampling.py``'s docstring says how).

    Args:
        max_num_gen_batches: sampling rounds per training step at most, the first included (verl's
            ``filter_groups.max_num_gen_batches``); >= 1.
    """

    max_num_gen_batches: int = 10

    def __post_init__(self) -> None:
        if self.max_num_gen_batches < 1:
            raise ConfigError(f"model.rollout.dynamic_sampling.max_num_gen_batches must be >= 1, got {self.max_num_gen_batches}")


@dataclass(frozen=True)
class EnvironmentOptions:
    """Multi-turn rollouts with an environment (``model.init_args.rollout.environment``; None: single-turn).

    Args:
        env_class: the environment class (``arctic_rl.rollout.environment.Environment``), e.g. a
            ``ToolEnvironment`` subclass; made per sample as ``cls(tokenizer=..., **env_args)``.
        env_args: its keyword arguments.
        max_turns: policy turns per episode at most (>= 1).
        max_observation_tokens: tokens of one observation at most; a longer one is a fault.
        step_timeout_s: seconds one ``env.step`` (a tool call) may run; past it, a fault (None: no limit).
        fault_reward: the reward of an episode that ended by a fault.
    """

    env_class: str
    env_args: dict = field(default_factory=dict)  # a bare dict: jsonargparse keeps its values as the YAML wrote them
    max_turns: int = 4
    max_observation_tokens: int = 256
    step_timeout_s: float | None = 30.0
    fault_reward: float = 0.0

    def __post_init__(self) -> None:
        where = "rollout.environment"
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ConfigError(f"model.{where}.max_turns must be an integer >= 1, got {self.max_turns!r}")
        if not isinstance(self.max_observation_tokens, int) or self.max_observation_tokens < 0:
            raise ConfigError(f"model.{where}.max_observation_tokens must be an integer >= 0, got {self.max_observation_tokens!r}")
        if self.step_timeout_s is not None:
            check_number(f"{where}.step_timeout_s", self.step_timeout_s, 0.0, low_open=True)
        check_number(f"{where}.fault_reward", self.fault_reward)
        if not isinstance(self.env_args, dict):
            raise ConfigError(f"model.{where}.env_args must be a mapping of keyword arguments, got {type(self.env_args).__name__}")
        environment_class(self.env_class)


def named_object(path: str, field: str):
    """The object at ``path`` (``package.module.name``) for the option ``field``; a ``ConfigError`` naming it otherwise."""
    module_name, _, name = str(path).rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"model.{field} {path!r} cannot be imported: {e}") from None


def environment_class(env_class: str) -> type:
    """The class at ``env_class`` (``package.module.Class``); a ``ConfigError`` naming the field otherwise."""
    cls = named_object(env_class, "rollout.environment.env_class")
    if not isinstance(cls, type):
        raise ConfigError(f"model.rollout.environment.env_class {env_class!r} must name a class (package.module.Class)")
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise ConfigError(f"model.rollout.environment.env_class {env_class!r}: the class has no {method}() (see"
                              " arctic_rl.rollout.environment.Environment)")
    return cls


@dataclass(frozen=True)
class AgentOptions:
    """Agent rollouts (``model.init_args.rollout.agent``; None: off): each sample is an episode of your agent function,
    ``async def agent(client, row) -> float``, run against an OpenAI-compatible endpoint on loopback that samples with
    the run's engine and records every token (``rollout/openai/agents.py``, ``docs/agents.md``). ``client`` is an
    ``openai.AsyncOpenAI`` whose requests carry the episode's session; ``row`` is the dataset row; the return value
    is the episode's reward.

    Args:
        agent_fn: the agent function (``package.module.function``, an ``async def``).
        max_in_flight: episodes running at once at most (the others wait their turn).
        max_turns: completion requests per episode at most; a request past it is refused (400).
        episode_timeout_s: seconds one episode may run; past it, it is cancelled, a fault (None: no limit).
        fault_reward: the reward of an episode that ended by a fault (the agent raised, timed out, or returned
            something that is not a finite number).
    """

    agent_fn: str
    max_in_flight: int = 64
    max_turns: int = 8
    episode_timeout_s: float | None = 300.0
    fault_reward: float = 0.0

    def __post_init__(self) -> None:
        where = "rollout.agent"
        for name in ("max_in_flight", "max_turns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{where}.{name} must be an integer >= 1, got {value!r}")
        if self.episode_timeout_s is not None:
            check_number(f"{where}.episode_timeout_s", self.episode_timeout_s, 0.0, low_open=True)
        check_number(f"{where}.fault_reward", self.fault_reward)
        agent_function(self.agent_fn)


def agent_function(agent_fn: str):
    """The ``async def`` at ``agent_fn`` (``package.module.function``); a ``ConfigError`` naming the field otherwise."""
    import inspect

    fn = named_object(agent_fn, "rollout.agent.agent_fn")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"model.rollout.agent.agent_fn {agent_fn!r} must name an async function (package.module.function):"
                          " async def agent(client, row) -> float")
    return fn


@dataclass(frozen=True)
class RolloutOptions:
    """From completions to advantages: rewards, their mix and time limit, and the advantage estimator
    (``model.init_args.rollout``).

    Args:
        advantage_estimator: ``grpo`` (mean-centred, scaled per ``scale_rewards``), ``dr_grpo`` (mean-only) or ``rloo``.
        scale_rewards: ``group``, ``batch`` or ``none``: the std that ``grpo`` advantages divide by.
        reward_weights: TRL's: a weight per named reward (None: 1 each).
        multi_objective_aggregation: ``sum_then_normalize`` or ``normalize_then_sum`` (GDPO) to mix named rewards
            (``rollout/rewards.py``).
        overlong_buffer: DAPO's soft overlong penalty, verl's ``overlong_buffer`` ``len``/``penalty_factor`` (None: off).
        dynamic_sampling: DAPO's dynamic sampling (verl's ``filter_groups``; None: off; ``rollout/dynamic_sampling.py``).
        reward_call_timeout_s: a call of ``reward`` (one rollout batch) still running after this many seconds
            stops the run with an error naming it, so no reward can stall training (None: no limit). For a limit and
            a fallback score per completion, score through ``arctic_rl.recipes.rewards.pool.SampleScorer``.
        environment: multi-turn rollouts with an environment (tools): ``env_class``, ``env_args``, ``max_turns``,
            ``max_observation_tokens``, ``step_timeout_s``, ``fault_reward`` (``rollout/multi_turn.py``,
            ``docs/multi_turn.md``; None: single-turn).
        agent: agent rollouts: your ``async def agent(client, row)`` against an OpenAI-compatible endpoint
            (``agent_fn``, ``max_in_flight``, ``max_turns``, ``episode_timeout_s``, ``fault_reward``; ``docs/agents.md``;
            None: off). Not with ``environment``.
    """

    advantage_estimator: AdvantageEstimator = "grpo"
    scale_rewards: RewardScaling = "group"
    reward_weights: dict[str, float] | None = None
    multi_objective_aggregation: RewardAggregation = "sum_then_normalize"
    overlong_buffer: OverlongBuffer | None = None
    dynamic_sampling: DynamicSampling | None = None
    reward_call_timeout_s: float | None = 900.0
    environment: EnvironmentOptions | None = None
    agent: AgentOptions | None = None

    def __post_init__(self) -> None:
        if self.reward_call_timeout_s is not None:
            check_number("rollout.reward_call_timeout_s", self.reward_call_timeout_s, 0.0, low_open=True)
        if self.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
            raise ConfigError("model.rollout.multi_objective_aggregation must be 'sum_then_normalize' or 'normalize_then_sum',"
                              f" got {self.multi_objective_aggregation!r}")
        if self.multi_objective_aggregation == "normalize_then_sum" and (self.advantage_estimator, self.scale_rewards) != ("grpo", "group"):
            raise ConfigError("model.rollout.multi_objective_aggregation 'normalize_then_sum' normalises the rewards itself (per group,"
                              " then over the batch, as TRL): leave model.rollout.advantage_estimator 'grpo' and"
                              " model.rollout.scale_rewards 'group'")
        for name, cls in (("overlong_buffer", OverlongBuffer), ("dynamic_sampling", DynamicSampling), ("environment", EnvironmentOptions),
                          ("agent", AgentOptions)):
            value = getattr(self, name)
            if isinstance(value, dict):  # as a checkpoint or a config keeps them: typed here, a bad value raises here
                object.__setattr__(self, name, cls(**value))
        if self.environment is not None and self.agent is not None:
            raise ConfigError("model.rollout.environment and model.rollout.agent are two ways to run episodes: set one")
