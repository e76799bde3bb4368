"""Rewards of a rollout batch: call the task's ``reward``, validate it, add DAPO's soft overlong penalty
and mix several named rewards into the one reward advantages are computed from.

``reward`` returns one list (one reward) or a dict of named lists (several reward functions, TRL's
``reward_funcs``). A value may be ``None`` where that function does not apply to the sample: it is skipped
for that sample (TRL's nan-aware sum). NaN, infinity, a wrong length or a sample no function scores is a
``RewardError`` naming the sample.
"""

from __future__ import annotations

import inspect
import math

import torch

from arctic_rl.errors import ConfigError
from arctic_rl.options.rollout import OverlongBuffer, RewardAggregation  # the options, here under their former path too
from arctic_rl.rollout.policy import RolloutPolicy
from arctic_rl.rollout.time_limit import CallTimedOut, call_with_time_limit
SINGLE = "reward"  # the name of a reward returned as one list
OVERLONG = "overlong_penalty"  # the name of DAPO's soft overlong penalty among the rewards
EPS = 1e-4  # TRL's epsilon in reward normalisation
FLOAT32_MAX = torch.finfo(torch.float32).max  # rewards leave score_completions as float32


class RewardError(RuntimeError):
    """A user reward function raised, or returned something unusable."""


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: OverlongBuffer) -> torch.Tensor:
    """DAPO eq. 13 times ``penalty_factor``: 0 up to ``max_length - buffer.len`` tokens, then falling
    linearly to ``-penalty_factor`` at ``max_length`` (and beyond). ``lengths``: ``[N]`` token counts."""
    excess = (lengths.double() - (max_length - buffer.len)).clamp(min=0) / buffer.len
    return -buffer.penalty_factor * excess.clamp(max=1.0)


def check_reward_columns(module: RolloutPolicy, columns: list[str], source: str) -> None:
    """Before any engine starts: ``module.reward`` and ``module.is_correct`` are plain functions (not
    ``async def``) that can be called with the data's ``columns`` as keyword arguments (each named
    parameter is a column of ``source``; other columns need a ``**columns`` parameter)."""
    for hook, function in (("reward", module.reward), ("is_correct", module.is_correct)):
        where = f"{type(module).__name__}.{hook}"
        if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
            raise ConfigError(f"{where} is 'async def': async rewards are not supported; make it a plain 'def'"
                              " (run any coroutines inside it with asyncio.run)")
        parameters = list(inspect.signature(function).parameters.values())
        named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"prompts", "completions"}
        missing = sorted(p.name for p in parameters if p.name in named and p.default is p.empty and p.name not in columns)
        if missing:
            raise ConfigError(f"{where} takes the column(s) {missing}, which {source} lacks (its columns: {sorted(columns)});"
                              " add them to the data or change the reward's parameters")
        unexpected = sorted(set(columns) - named)
        if unexpected and not any(p.kind is p.VAR_KEYWORD for p in parameters):
            raise ConfigError(f"{where} has no parameter for the column(s) {unexpected} of {source}, which it is passed;"
                              " add **columns to its parameters")


def call_reward(module: RolloutPolicy, prompts: list, completions: list[str], columns: dict[str, list],
                time_limit_s: float | None = None) -> dict[str, torch.Tensor]:
    """``module.reward``'s answer as named ``[N]`` float64 tensors (one list is named ``"reward"``),
    ``None`` as NaN. Raises ``RewardError`` naming the sample for anything unusable, and when the call
    runs past ``time_limit_s`` seconds (``rollout/time_limit.py``; None: no limit)."""
    n, where = len(completions), f"{type(module).__name__}.reward"
    try:
        out = call_with_time_limit(lambda: module.reward(prompts=prompts, completions=completions, **columns), time_limit_s)
    except CallTimedOut:
        raise RewardError(f"{where} was stopped: {n} completions were still being scored after model.rollout.reward_call_timeout_s="
                          f"{time_limit_s:g} s (first prompt {str(prompts[0])[:80]!r}); raise the limit, or score each completion"
                          " under its own limit and fallback (arctic_rl.recipes.rewards.pool.SampleScorer)") from None
    except Exception as e:
        raise RewardError(f"{where} raised {type(e).__name__}: {e} (scoring {n} completions; first prompt {str(prompts[0])[:80]!r})") from e
    if inspect.isawaitable(out):
        if inspect.iscoroutine(out):
            out.close()  # so Python does not also warn that it was never awaited
        raise RewardError(f"{where} returned a coroutine: async rewards are not supported; make it a plain 'def'")
    if not isinstance(out, dict):
        return {SINGLE: _checked(where, out, prompts, completions)}
    if not out:
        raise RewardError(f"{where} returned an empty dict; return a list of {n} floats or a dict of named lists")
    return {str(name): _checked(f"{where}[{name!r}]", values, prompts, completions) for name, values in out.items()}


def _checked(where: str, out, prompts: list, completions: list[str]) -> torch.Tensor:
    n = len(completions)
    try:
        out = list(out)
        values = [math.nan if v is None else _finite(v) for v in out]
    except (TypeError, ValueError) as e:
        raise RewardError(f"{where} must return a list of {n} floats (None where it does not apply), got {type(out).__name__}: {e}") from None
    if len(values) != n:
        raise RewardError(f"{where} returned {len(values)} rewards for {n} completions")
    for i, v in enumerate(values):
        sample = f"sample {i} (prompt {str(prompts[i])[:80]!r}, completion {completions[i][:80]!r})"
        if math.isinf(v) or (math.isnan(v) and out[i] is not None):
            raise RewardError(f"{where} returned {v} for {sample}")
        if abs(v) > FLOAT32_MAX:
            raise RewardError(f"{where} returned {v:g} for {sample}: it overflows float32 (largest {FLOAT32_MAX:.4g}),"
                              " in which rewards and advantages are computed; scale the reward down")
    return torch.tensor(values, dtype=torch.float64)


def _finite(value) -> float:
    if isinstance(value, str):
        raise TypeError(f"a string {value[:20]!r}")
    return float(value)


def aggregate_rewards(components: dict[str, torch.Tensor], weights: dict[str, float], group_size: int,
                      aggregation: RewardAggregation) -> torch.Tensor:
    """One reward per sample ``[N]``, the one advantages are computed from, from named ``[N]`` rewards
    (NaN: not applicable), TRL 1.16's ``multi_objective_aggregation``:

    - ``sum_then_normalize``: :func:`weighted_reward`; the advantage estimator then normalises it
      (``scale_rewards``).
    - ``normalize_then_sum`` (GDPO, arXiv 2601.05242): each function is first normalised within the
      group, ``(r_k - mean) / (std + 1e-4)`` over the samples it applies to (unbiased std), then
      ``sum_k w_k`` of those; advantages are then normalised over the batch.

    A name missing from ``weights`` has weight 1. Raises ``RewardError`` naming a sample no function scores.
    """
    names = list(components)
    values = torch.stack([components[k].double() for k in names], dim=1)  # [N, K]
    unscored = values.isnan().all(dim=1).nonzero().flatten().tolist()
    if unscored:
        raise RewardError(f"no reward function scored samples {unscored[:10]} (every one of {names} returned None)")
    if aggregation == "sum_then_normalize":
        return weighted_reward(components, weights)
    if aggregation != "normalize_then_sum":
        raise ConfigError(f"model.rollout.multi_objective_aggregation must be 'sum_then_normalize' or 'normalize_then_sum', got {aggregation!r}")
    grouped = values.view(-1, group_size, len(names))
    mean = grouped.nanmean(dim=1, keepdim=True)
    count = (~grouped.isnan()).sum(dim=1, keepdim=True)
    var = ((grouped - mean) ** 2).nansum(dim=1, keepdim=True) / (count - 1)  # 0/0 (one value) -> NaN: skipped
    normalized = ((grouped - mean) / (var.sqrt() + EPS)).view(-1, len(names))
    return weighted_reward(dict(zip(names, normalized.unbind(dim=1))), weights)


def weighted_reward(components: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """``sum_k w_k r_k`` per sample ``[N]`` float64 over the functions that apply (TRL's nan-aware sum;
    weight 1 for a name missing from ``weights``): each sample's reward, as TRL logs it (``reward``) under
    either aggregation."""
    values = torch.stack([v.double() for v in components.values()], dim=1)  # [N, K]
    w = torch.tensor([weights.get(k, 1.0) for k in components], dtype=torch.float64)
    return (values * w).nansum(dim=1)


def batch_normalized_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``(R - mean) / (std + 1e-4)`` over the whole batch (unbiased std): the advantages of TRL's
    ``normalize_then_sum``, whose summed rewards ``R`` are already normalised per group and function."""
    r = rewards.double()
    std = r.std() if r.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return ((r - r.mean()) / (std + EPS)).to(rewards.dtype)


def check_weights(weights: dict[str, float] | None, names: list[str]) -> dict[str, float]:
    """``model.rollout.reward_weights`` against the names ``reward`` returned: the same names, finite weights."""
    if weights is None:
        return {}
    returned = [k for k in names if k != OVERLONG]
    missing, unknown = sorted(set(returned) - set(weights)), sorted(set(weights) - set(returned))
    if missing or unknown:
        raise RewardError(f"model.rollout.reward_weights must name each reward returned, {returned}: "
                          + "; ".join(([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])))
    bad = {k: w for k, w in weights.items() if not math.isfinite(w)}
    if bad:
        raise RewardError(f"model.rollout.reward_weights must be finite, got {bad}")
    return dict(weights)


def score_completions(module: RolloutPolicy, prompts: list, completions: list[str], columns: dict[str, list],
                      lengths: list[int] | None = None, extra: dict[str, torch.Tensor] | None = None, call_user: bool = True,
                      not_applicable: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Score ``N`` completions: ``(advantage reward [N], reward [N], named rewards)``, float32. The
    advantage reward is what advantages are computed from (:func:`aggregate_rewards`); the reward is each
    sample's weighted sum of its named rewards (:func:`weighted_reward`, what is logged as ``reward``); the
    two are equal under ``sum_then_normalize``. The named rewards (NaN where a function returned None) are
    what ``reward`` returned plus ``overlong_penalty`` when ``model.rollout.overlong_buffer`` is set; empty when
    ``reward`` returned one list and no penalty applies. ``lengths`` (token counts) are needed with
    ``overlong_buffer``. Multi-turn (``multi_turn.py``): ``extra`` named ``[N]`` rewards join ``reward``'s (the
    environment's), ``call_user`` False skips ``reward`` (a module that does not override it), and
    ``not_applicable`` ``[N]`` bool marks the samples ``reward``'s values are NaN for (faulted episodes)."""
    hp, max_length = module.options.rollout, module.options.sampling.max_response_length
    components = call_reward(module, prompts, completions, columns, hp.reward_call_timeout_s) if call_user else {}
    if not_applicable is not None:
        components = {k: v.masked_fill(not_applicable, math.nan) for k, v in components.items()}
    for name, values in (extra or {}).items():
        if name in components:
            raise RewardError(f"{type(module).__name__}.reward returned a reward named {name!r}, which the environment's reward is named")
        components[name] = values.double()
    weights = check_weights(hp.reward_weights, list(components))
    buffer = hp.overlong_buffer
    if buffer is not None:
        if OVERLONG in components:
            raise RewardError(f"{type(module).__name__}.reward returned a reward named {OVERLONG!r}, which model.rollout.overlong_buffer adds")
        components[OVERLONG] = overlong_penalty(torch.tensor(lengths), max_length, buffer)
    total = aggregate_rewards(components, weights, module.group_size, hp.multi_objective_aggregation)
    overflowing = (total.abs() > FLOAT32_MAX).nonzero().flatten().tolist()
    if overflowing:
        i = overflowing[0]
        raise RewardError(f"the weighted sum of {type(module).__name__}.reward's rewards for sample {i} (prompt"
                          f" {str(prompts[i])[:80]!r}) is {total[i].item():g}, which overflows float32; scale the rewards down")
    named = {} if list(components) == [SINGLE] else {k: v.float() for k, v in components.items()}
    return total.float(), weighted_reward(components, weights).float(), named


def reward_metrics(components: dict[str, torch.Tensor]) -> dict[str, float]:
    """TRL's ``rewards/<name>/mean`` and ``/std`` of each named reward, over the samples it applies to."""
    metrics = {}
    for name, values in components.items():
        applied = values[~values.isnan()].double()
        metrics[f"rewards/{name}/mean"] = applied.mean().item() if applied.numel() else math.nan
        metrics[f"rewards/{name}/std"] = applied.std().item() if applied.numel() > 1 else 0.0
    return metrics


def samples_table(rollout, step: int, count: int) -> tuple[list[str], list[list]]:
    """Columns and rows of the logged samples (the first ``count`` of ``rollout``): step, prompt,
    completion, reward, then each named reward (None where it does not apply)."""
    names = list(rollout.reward_components)
    rows = []
    for i in range(min(count, rollout.num_sequences)):
        named = [rollout.reward_components[k][i].item() for k in names]
        rows.append([step, str(rollout.prompts[i]), rollout.completions[i], rollout.rewards[i].item(),
                     *[None if math.isnan(v) else v for v in named]])
    return ["step", "prompt", "completion", "reward", *names], rows
