"""Tinker datums (next-token layout) to arctic-rl ``TrainBatch``es (a prompt and a response per sequence),
and back: the pure conversions behind both Tinker front doors (``arctic-rl serve --api tinker`` and the
SkyRL adapter), with every refusal naming the datum and field.

A Tinker datum is ``model_input`` tokens ``x[0:n]``, ``target_tokens`` ``x[1:n+1]`` and per-target
``weights`` (>= 0; absent: 1) / ``advantages`` / ``logprobs``. Its loss is a sum over targets of
``weight * f(...)``; where ``f`` is linear in the advantage the weight is folded into it. A
target with weight 0 (or, for the importance-weighted losses, advantage 0) adds exactly nothing to the loss
or the gradient. So arctic-rl trains, as the response, the span from the first to the last target that
contributes, with everything before it as the prompt (for a GRPO datum: the real prompt, so ZoRRo computes
it once per group), and drops only targets after the span (they cannot change an earlier log-prob).
Inside the span a target that contributes nothing (multi-turn: an observation's tokens, weight 0) is a hole
in the response's loss mask, still an input of the forward; advantages go per token. ``dro``'s penalty
counts on every weighted target, so for it only weight 0 leaves a target out; the same holds for a registered
arctic-rl loss that the SkyRL backend runs in place of Tinker's (its form is unknown). Anything else is refused.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from arctic_rl.serve.batch import MAX_ABS_ADVANTAGE, TrainBatch

RATIO_LOSSES = ("importance_sampling", "ppo", "cispo")  # a target with advantage 0 adds nothing
POLICY_LOSSES = (*RATIO_LOSSES, "dro")  # need advantages and the sampler's log-probs
SUPPORTED_LOSSES = ("cross_entropy", *POLICY_LOSSES)


class TinkerInputError(ValueError):
    """A Tinker request arctic-rl cannot express as an arctic-rl batch; the message names the field."""


@dataclass
class Datum:
    """One Tinker datum, as plain lists (``advantages``/``logprobs`` empty when not sent)."""

    tokens: list[int]  # [n] model_input
    targets: list[int]  # [n] target_tokens
    weights: list[float]  # [n]
    advantages: list[float]  # [n] or []
    logprobs: list[float]  # [n] or [] (the sampler's)
    chunk_lengths: list[int] = field(default_factory=list)  # model_input's chunks (refusals name them); []: one chunk


def _check_layout(i: int, d: Datum, check_values: bool = True) -> int:
    """The number of targets of datum ``i``, once its lengths, next-token layout and (``check_values``) the range of its
    weights, advantages and log-probs are checked."""
    n = len(d.tokens)
    if n == 0:
        raise TinkerInputError(f"datum {i}: model_input has no tokens")
    for name, values in (("target_tokens", d.targets), ("weights", d.weights)):
        if len(values) != n:
            raise TinkerInputError(f"datum {i}: loss_fn_inputs.{name} has {len(values)} entries for {n} model_input tokens")
    for name, values in (("advantages", d.advantages), ("logprobs", d.logprobs)):
        if values and len(values) != n:
            raise TinkerInputError(f"datum {i}: loss_fn_inputs.{name} has {len(values)} entries for {n} model_input tokens")
    if d.tokens[1:] != d.targets[:-1]:
        p = next(j for j in range(n - 1) if d.tokens[j + 1] != d.targets[j])
        raise TinkerInputError(f"datum {i}: target_tokens[{p}] != model_input[{p + 1}]; arctic-rl needs the next-token layout"
                               " (targets = the sequence shifted by one)")
    if check_values:
        _check_values(i, d)
    return n


def _check_values(i: int, d: Datum) -> None:
    bad = [j for j, w in enumerate(d.weights) if not 0 <= w < float("inf")]
    if bad:
        raise TinkerInputError(f"datum {i}: loss_fn_inputs.weights[{bad[0]}] = {d.weights[bad[0]]}; weights must be >= 0")
    bad = [j for j, a in enumerate(d.advantages) if not abs(a) <= MAX_ABS_ADVANTAGE]  # NaN too
    if bad:
        raise TinkerInputError(f"datum {i}: loss_fn_inputs.advantages[{bad[0]}] = {d.advantages[bad[0]]:g}; inputs this large "
                               f"overflow float32: advantages must be finite, of magnitude at most {MAX_ABS_ADVANTAGE:g}")
    bad = [j for j, lp in enumerate(d.logprobs) if not -float("inf") < lp <= 0]
    if bad:
        raise TinkerInputError(f"datum {i}: loss_fn_inputs.logprobs[{bad[0]}] = {d.logprobs[bad[0]]:g}; the sampler's "
                               "log-probs must be finite and <= 0 (a probability is at most 1)")


def _values_in_range(datums: list[Datum]) -> bool:
    """Whether every datum passes ``_check_values``: the same comparisons over all the request's values at once
    (False also when a value is not a plain number; the datum-by-datum check then names what is wrong)."""
    try:
        weights, advantages, logprobs = (np.fromiter(itertools.chain.from_iterable(getattr(d, name) for d in datums), np.float64)
                                         for name in ("weights", "advantages", "logprobs"))
    except (TypeError, ValueError, OverflowError):
        return False
    return bool(((weights >= 0) & (weights < math.inf)).all() and (np.abs(advantages) <= MAX_ABS_ADVANTAGE).all()
                and ((logprobs > -math.inf) & (logprobs <= 0)).all())


def check_vocabulary(datums: list[Datum], vocab_size: int) -> None:
    """Every ``model_input`` token and ``target_tokens`` entry of ``datums`` inside ``[0, vocab_size)``."""
    for i, d in enumerate(datums):
        bad = [j for j, t in enumerate(d.tokens) if not 0 <= t < vocab_size]
        if bad:
            chunk, offset = _chunk_of(d.chunk_lengths or [len(d.tokens)], bad[0])
            raise TinkerInputError(f"datum {i}: model_input.chunks[{chunk}].tokens[{offset}] = {d.tokens[bad[0]]} is outside "
                                   f"the model's vocabulary [0, {vocab_size})")
        bad = [j for j, t in enumerate(d.targets) if not 0 <= t < vocab_size]
        if bad:
            raise TinkerInputError(f"datum {i}: loss_fn_inputs.target_tokens[{bad[0]}] = {d.targets[bad[0]]} is outside the "
                                   f"model's vocabulary [0, {vocab_size})")


def _chunk_of(lengths: list[int], position: int) -> tuple[int, int]:
    """``(chunk, offset in it)`` of token ``position`` of a model input made of chunks of ``lengths``."""
    for chunk, length in enumerate(lengths):
        if position < length:
            return chunk, position
        position -= length
    return len(lengths) - 1, position


def train_sequence(i: int, d: Datum, loss_fn: str, registered: bool = False, *,
                   values_checked: bool = False) -> tuple[list[int], list[int], list[float], list[float], list[int]]:
    """``(prompt, response, advantages, sampler_logprobs, loss_mask)`` of datum ``i`` for ``forward_backward``
    (``advantages``, ``sampler_logprobs`` and ``loss_mask`` one per response token). ``registered``: ``loss_fn``
    runs a registered arctic-rl loss of unknown form instead of Tinker's (the SkyRL backend's choice), which takes
    the advantages and sampler log-probs of each target, and weights 0 or 1 only (as ``dro``). ``values_checked``:
    the caller found every value in range already (``train_batch``, for the whole request at once)."""
    if loss_fn not in SUPPORTED_LOSSES and not registered:
        raise TinkerInputError(f"loss_fn {loss_fn!r} is not supported by arctic-rl; supported: {list(SUPPORTED_LOSSES)}")
    n = _check_layout(i, d, check_values=not values_checked)
    policy = registered or loss_fn in POLICY_LOSSES
    if policy:
        for name in ("advantages", "logprobs"):
            if not getattr(d, name):
                raise TinkerInputError(f"datum {i}: loss_fn {loss_fn!r} needs loss_fn_inputs.{name}")
    by_ratio = loss_fn in RATIO_LOSSES and not registered
    contributes = [j for j in range(n) if d.weights[j] != 0 and (not by_ratio or d.advantages[j] != 0)]
    if not contributes:  # adds nothing to loss or gradient: a one-token response of weight 0 keeps it counted
        return d.tokens, d.targets[-1:], [0.0], (d.logprobs or [0.0] * n)[-1:], [1]
    start, end = contributes[0], contributes[-1] + 1
    mask = [0] * (end - start)
    for j in contributes:
        mask[j - start] = 1
    if loss_fn == "dro" or registered:  # not linear in the advantage: a weight can only keep a target or drop it
        bad = [j for j in contributes if d.weights[j] != 1]
        if bad:
            what = "a registered arctic-rl loss" if registered else "dro"
            raise TinkerInputError(f"datum {i}: loss_fn_inputs.weights[{bad[0]}] = {d.weights[bad[0]]}; {what} takes weights 0 and 1")
        advantages = d.advantages[start:end]
    else:  # the loss is linear in weight * advantage (cross_entropy: A = 1), so the weight goes into the advantage
        advantages = [d.weights[j] * (d.advantages[j] if policy else 1.0) for j in range(start, end)]
    sampler = d.logprobs[start:end] if d.logprobs else [0.0] * (end - start)
    return d.tokens[: start + 1], d.targets[start:end], advantages, sampler, mask


def train_batch(datums: list[Datum], loss_fn: str, registered: bool = False) -> TrainBatch:
    """The ``TrainBatch`` of one Tinker ``forward_backward`` request (in the request's order); ``registered``:
    ``loss_fn`` runs a registered arctic-rl loss instead of Tinker's (``train_sequence``)."""
    checked = _values_in_range(datums)  # else each datum is checked in turn, and the first bad value named
    rows = [train_sequence(i, d, loss_fn, registered, values_checked=checked) for i, d in enumerate(datums)]
    prompts, responses, advantages, sampler, masks = (list(col) for col in zip(*rows))
    return TrainBatch.build(prompts, responses, advantages, loss_masks=masks, sampler_logprobs=sampler)


def target_sources(datums: list[Datum], batch: TrainBatch) -> tuple[TrainBatch | None, list[tuple[int, int]]]:
    """Where the log-prob of each target of each datum comes from, once ``batch`` (``train_batch``'s) has run
    through ``forward_backward``: the loss's own forward answers a datum's trained span when the span has no hole
    and reaches its last target; the targets before it (the prompt's) come from a no-grad forward over each
    distinct prompt once (a GRPO group's datums share it). A datum with a hole or with targets after its span
    is answered whole by that forward. Returns that forward's batch (None: nothing to run) and, per datum,
    ``(row, k)``: targets ``[0, k)`` from the forward's ``row``, targets ``[k, n)`` from the datum's own response."""
    mask = batch.response_mask != 0
    widths = mask.sum(1).tolist()  # trained targets: the span's when it has no hole
    leading = mask.cumprod(1).sum(1).tolist()  # the span's first targets before a hole
    sequences: dict[tuple[int, ...], int] = {}
    plan = []
    for d, prompt, width, lead in zip(datums, batch.prompt_token_ids, widths, leading):
        n, start = len(d.targets), len(prompt) - 1
        k = n if start + width != n or lead < width else start
        if k == 0:
            plan.append((-1, 0))
            continue
        key = tuple(d.tokens[:1] + d.targets[:k])
        plan.append((sequences.setdefault(key, len(sequences)), k))
    if not sequences:
        return None, plan
    return TrainBatch.build([list(s[:1]) for s in sequences], [list(s[1:]) for s in sequences]), plan


def target_logprobs(trained: torch.Tensor, before: torch.Tensor | None, plan: list[tuple[int, int]],
                    lengths: list[int]) -> np.ndarray:
    """Every datum's target log-probs, datum after datum, as float32: per ``target_sources``' ``plan`` entry
    ``(row, k)`` of a datum of ``lengths[i]`` targets, ``before[row, :k]`` then ``trained[i, :lengths[i] - k]``
    (``trained``: the loss forward's ``[N, R]``; ``before``: the no-grad forward's, None when it did not run)."""
    rows = np.array([row for row, _ in plan], dtype=np.int64)
    ks = np.array([k for _, k in plan], dtype=np.int64)  # targets from the no-grad forward
    ns = np.array(lengths, dtype=np.int64)
    ms = ns - ks  # targets from the datum's own response
    out_start = np.cumsum(ns) - ns
    flat = [trained.reshape(-1)] if before is None else [before.reshape(-1), trained.reshape(-1)]
    trained_start = 0 if before is None else before.numel()
    from_before = rows * (0 if before is None else before.shape[1])
    from_trained = trained_start + np.arange(len(plan), dtype=np.int64) * trained.shape[1]
    index = np.empty(int(ns.sum()), dtype=np.int64)  # into ``flat`` concatenated, for each value of the answer
    for count, source, target in ((ks, from_before, out_start), (ms, from_trained, out_start + ks)):
        runs = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)  # 0..count[i]-1, run after run
        index[np.repeat(target, count) + runs] = np.repeat(source, count) + runs
    values = torch.cat(flat)
    return values[torch.from_numpy(index)].to(torch.float32).numpy()


def forward_batch(datums: list[Datum]) -> TrainBatch:
    """A batch whose log-probs cover every target of every datum: the first token as the prompt, the
    targets as the response (Tinker's ``forward`` answers a log-prob for each target)."""
    for i, d in enumerate(datums):
        _check_layout(i, d)
    return TrainBatch.build([d.tokens[:1] for d in datums], [d.targets for d in datums])


def tensor_output(values: list[float]) -> dict:
    """A Tinker ``TensorData``-shaped output entry."""
    return {"data": [float(v) for v in values], "dtype": "float32", "shape": [len(values)]}
