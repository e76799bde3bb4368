"""``TrainBatch``: the sequences a client sends for ``forward`` / ``forward_backward``, checked field by
field, and its conversion to and from a wire ``Message`` and to the trainer's ``RolloutBatch``."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields

import numpy as np
import torch

from arctic_rl.rollout.batch import RolloutBatch
from arctic_rl.serve.errors import RequestError
from arctic_rl.serve.transport import Message

_OPTIONAL = ("old_logprobs", "sampler_logprobs", "ref_logprobs")
# the largest |advantage| a request may send: the loss's gradient scales with it, and the gradient's norm sums its
# squares over every weight, which overflows float32 (3.4e38) well before an advantage itself would
MAX_ABS_ADVANTAGE = 1e10


@dataclass
class TrainBatch:
    """``N`` sequences, each a prompt and a response. Sequences that share a prompt should be contiguous
    (a GRPO group): ZoRRo then computes the prompt once for all of them (it finds them by hashing)."""

    prompt_token_ids: list[list[int]]  # N lists (varlen, no padding)
    response_ids: torch.Tensor  # [N, R] long, right-padded
    # [N, R] float: 1.0 on the tokens trained on; 0.0 on padding and, inside a response, on tokens the policy
    # did not generate (multi-turn tool or environment observations: model inputs, never targets). A
    # response ends at its last 1.0 (``response_extents``); its ids up to there are all inputs
    response_mask: torch.Tensor
    advantages: torch.Tensor | None = None  # [N] or [N, R] (per token) float; forward_backward needs it
    old_logprobs: torch.Tensor | None = None  # [N, R] policy before this batch's updates (None: on-policy)
    sampler_logprobs: torch.Tensor | None = None  # [N, R] from the rollout engine (only a metric)
    ref_logprobs: torch.Tensor | None = None  # [N, R] frozen reference (KL losses; else the server computes them)

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_token_ids)

    @classmethod
    def build(cls, prompt_token_ids: list[list[int]], response_ids: list[list[int]], advantages=None,
              loss_masks: list[list[int]] | None = None, **optional) -> "TrainBatch":
        """From plain lists: ``response_ids`` are ragged token lists (padded and masked here); ``advantages``
        ``[N]``, or per token as ragged lists (padded with 0); ``loss_masks``: per response, 1 on the tokens to train on and 0 on the others (multi-turn:
        the observation tokens between turns), as long as its response (default: all 1); optional
        ``old_logprobs`` / ``sampler_logprobs`` / ``ref_logprobs`` as ragged lists or ``[N, R]``."""
        n = len(response_ids)
        lengths = _lengths(response_ids)
        width = int(lengths.max()) if n else 0
        if loss_masks is not None and len(loss_masks) != n:
            raise ValueError(f"TrainBatch.build: {len(loss_masks)} loss_masks for {n} responses")
        ids = _ragged(response_ids, lengths, width, torch.long)
        if loss_masks is None:
            mask = (torch.arange(width)[None, :] < torch.from_numpy(lengths)[:, None]).float()
        else:
            mask = _loss_masks(loss_masks, lengths, width)
        tensors = {}
        for name, value in optional.items():
            if name not in _OPTIONAL:
                raise TypeError(f"TrainBatch.build got an unexpected field {name!r}; optional fields: {list(_OPTIONAL)}")
            tensors[name] = _padded(value, n, width) if value is not None and not isinstance(value, torch.Tensor) else value
        per_token = advantages is not None and any(isinstance(a, (list, tuple)) for a in advantages)
        adv = _padded(advantages, n, width) if per_token else None if advantages is None else torch.as_tensor(advantages, dtype=torch.float32)
        return cls([list(p) for p in prompt_token_ids], ids, mask, adv, **tensors)

    # ------------------------------------------------------------------ wire
    def to_message(self, meta: dict | None = None) -> Message:
        lengths = torch.tensor([len(p) for p in self.prompt_token_ids], dtype=torch.long)
        flat = torch.tensor([t for p in self.prompt_token_ids for t in p], dtype=torch.long)
        tensors = {"prompt_ids": flat, "prompt_lengths": lengths, "response_ids": self.response_ids.long(),
                   "response_mask": self.response_mask.float()}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("advantages", *_OPTIONAL) and value is not None:
                tensors[f.name] = value
        return Message(dict(meta or {}), tensors)

    @classmethod
    def from_message(cls, message: Message) -> "TrainBatch":
        """Decode and check a request's batch; every problem is a ``RequestError`` naming the field."""
        t = message.tensors
        for name in ("prompt_ids", "prompt_lengths", "response_ids", "response_mask"):
            if name not in t:
                raise RequestError(f"batch.{name} is missing")
        lengths, flat = _integer("prompt_lengths", t["prompt_lengths"], 1), _integer("prompt_ids", t["prompt_ids"], 1)
        if (lengths < 1).any():
            raise RequestError(f"batch.prompt_lengths: every prompt needs >= 1 token (sequence {int((lengths < 1).nonzero()[0])} has none)")
        if int(lengths.sum()) != flat.numel():
            raise RequestError(f"batch.prompt_ids has {flat.numel()} tokens, prompt_lengths sum to {int(lengths.sum())}")
        prompts = [chunk.tolist() for chunk in torch.split(flat, lengths.tolist())]
        response_ids = _integer("response_ids", t["response_ids"], 2)
        n, width = response_ids.shape
        if n != len(prompts) or n == 0:
            raise RequestError(f"batch.response_ids has {n} rows for {len(prompts)} prompts (need equal, >= 1)")
        if width == 0:
            raise RequestError("batch.response_ids has width 0: every batch needs at least one response token")
        mask = _floating("response_mask", t["response_mask"], (n, width))
        if not ((mask == 0) | (mask == 1)).all():
            raise RequestError("batch.response_mask must hold only 0 and 1")
        if not mask.any():
            raise RequestError("batch.response_mask is all zeros: no response token to compute anything on")
        batch = cls(prompts, response_ids, mask)
        if "advantages" in t:
            per_token = t["advantages"].dim() == 2
            batch.advantages = _floating("advantages", t["advantages"], (n, width) if per_token else (n,))
        for name in _OPTIONAL:
            if name in t:
                setattr(batch, name, _floating(name, t[name], (n, width)))
        extra = set(t) - {"prompt_ids", "prompt_lengths", "response_ids", "response_mask", "advantages", *_OPTIONAL}
        if extra:
            raise RequestError(f"batch: unknown tensors {sorted(extra)}")
        return batch

    def overflow_suspects(self) -> str:
        """The inputs that can make the loss overflow float32, by name with their largest magnitude on response
        tokens: log-probs below -88.7 (``exp`` of a difference of them overflows) and advantages over 1.8e19 (a
        product of two overflows). When none is that large, every float input is listed."""
        limits = {"advantages": math.sqrt(torch.finfo(torch.float32).max), **{name: math.log(torch.finfo(torch.float32).max)
                                                                              for name in _OPTIONAL}}
        mask = self.response_mask.bool()
        largest = {}
        for name, limit in limits.items():
            value = getattr(self, name)
            if value is not None:
                largest[name] = (float((value if value.dim() == 1 else value[mask]).abs().max()), limit)
        suspects = {name: big for name, (big, limit) in largest.items() if big > limit}
        shown = suspects or {name: big for name, (big, _) in largest.items()}
        return ", ".join(f"batch.{name} (largest |value| {big:.3g})" for name, big in shown.items())

    # ------------------------------------------------------------------ trainer side
    def check_limits(self, vocab_size: int, max_prompt_length: int, max_response_length: int) -> None:
        """Token ids inside the vocabulary, lengths inside the job's limits and advantages of magnitude at most
        ``MAX_ABS_ADVANTAGE`` (``RequestError`` otherwise)."""
        longest = max(len(p) for p in self.prompt_token_ids)
        if longest > max_prompt_length:
            raise RequestError(f"batch: a prompt has {longest} tokens, over sampling.max_prompt_length={max_prompt_length}")
        if self.response_ids.shape[1] > max_response_length:
            raise RequestError(f"batch: responses are {self.response_ids.shape[1]} tokens wide, over sampling.max_response_length={max_response_length}")
        for i, prompt in enumerate(self.prompt_token_ids):
            if min(prompt) < 0 or max(prompt) >= vocab_size:
                raise RequestError(f"batch.prompt_ids: sequence {i} has a token id outside [0, {vocab_size})")
        used = self.response_ids[self._inside()]
        if used.numel() and (used.min() < 0 or used.max() >= vocab_size):
            raise RequestError(f"batch.response_ids: a token id outside [0, {vocab_size})")
        if self.advantages is not None:
            values = self.advantages if self.advantages.dim() == 1 else self.advantages[self.response_mask.bool()]
            big = float(values.abs().max()) if values.numel() else 0.0
            if big > MAX_ABS_ADVANTAGE:
                raise RequestError(f"inputs this large overflow float32: batch.advantages (largest |value| {big:.3g}) is over "
                                   f"{MAX_ABS_ADVANTAGE:g}; scale the advantages down")

    def _inside(self) -> torch.Tensor:
        """``[N, R]`` bool: the positions up to each response's last 1.0 in ``response_mask`` (its tokens)."""
        width = self.response_mask.shape[1]
        last = torch.where(self.response_mask != 0, torch.arange(1, width + 1), 0).amax(-1)
        return torch.arange(width)[None, :] < last[:, None]

    def to_rollout_batch(self, pad_token_id: int) -> RolloutBatch:
        """The trainer's container; positions past each response's end get ``pad_token_id`` (masked tokens
        inside a response stay: they are inputs). The group size is the length of the runs of equal prompts
        when they are all equal, else 1 (it only picks the self-check's probe)."""
        n = self.num_sequences
        inside = self._inside()
        ids = torch.where(inside, self.response_ids, torch.full_like(self.response_ids, pad_token_id))
        holes = (inside & (self.response_mask == 0)).to(self.response_mask.dtype)  # multi-turn observations
        zeros = torch.zeros(n)
        return RolloutBatch(
            prompt_token_ids=self.prompt_token_ids, response_ids=ids, response_mask=self.response_mask,
            sampler_logprobs=self.sampler_logprobs if self.sampler_logprobs is not None else torch.zeros_like(self.response_mask),
            rewards=zeros, advantages=self.advantages if self.advantages is not None else zeros,
            group_size=_group_size(self.prompt_token_ids), old_logprobs=self.old_logprobs, ref_logprobs=self.ref_logprobs,
            observation_mask=holes if holes.any() else None,
        )


def _padded(rows, n: int, width: int) -> torch.Tensor:
    """Ragged float rows as ``[n, width]``, right-padded with 0."""
    if len(rows) > n:
        raise IndexError(f"{len(rows)} rows for {n} responses")
    return _ragged(rows, _lengths(rows), width, torch.float32, n)


def _lengths(rows) -> np.ndarray:
    return np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))


def _ragged(rows, lengths: np.ndarray, width: int, dtype: torch.dtype, n: int | None = None) -> torch.Tensor:
    """``rows`` (lists, or anything ``torch.as_tensor`` reads; ``lengths`` theirs) as ``[n, width]`` of ``dtype``
    (``n``: default ``len(rows)``), right-padded with 0: one conversion of all the values, each as ``torch.as_tensor``
    converts it. A row longer than ``width`` is a ``RuntimeError``."""
    out = torch.zeros((len(rows) if n is None else n, width), dtype=dtype)
    if all(type(row) is list for row in rows):  # noqa: E721  (lists of numbers: one pass over them all)
        flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(rows), dtype=_NUMPY[dtype], count=int(lengths.sum())))
    else:
        flat = torch.cat([torch.as_tensor(row, dtype=dtype).reshape(-1) for row in rows]) if len(rows) else out.reshape(-1)
    out[: len(rows)][torch.arange(width)[None, :] < torch.from_numpy(lengths)[:, None]] = flat
    return out


def _loss_masks(loss_masks, lengths: np.ndarray, width: int) -> torch.Tensor:
    """``TrainBatch.build``'s ``loss_masks`` as ``[N, width]`` floats, each as long as its response and of 0s and 1s."""
    sizes = _lengths(loss_masks)
    try:
        mask = _ragged(loss_masks, sizes, width, torch.float32) if (sizes == lengths).all() else None
    except (TypeError, ValueError):
        mask = None
    if mask is None or not ((mask == 0) | (mask == 1)).all():
        for i, row in enumerate(loss_masks):  # the first one that is not 0s and 1s, as long as its response, named
            if len(row) != lengths[i] or any(v not in (0, 1) for v in row):
                raise ValueError(f"TrainBatch.build: loss_masks[{i}] must be {lengths[i]} values of 0 or 1 (one per response token)")
    return mask


_NUMPY = {torch.long: np.int64, torch.float32: np.float32}
def _group_size(prompts: list[list[int]]) -> int:
    runs, start = [], 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or prompts[i] != prompts[start]:
            runs.append(i - start)
            start = i
    return runs[0] if len(set(runs)) == 1 else 1


def _integer(name: str, tensor: torch.Tensor, dim: int) -> torch.Tensor:
    if tensor.dtype not in (torch.int64, torch.int32) or tensor.dim() != dim:
        raise RequestError(f"batch.{name} must be a {dim}-d int64 tensor, got {tensor.dim()}-d {tensor.dtype}")
    return tensor.long()


def _floating(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if not tensor.dtype.is_floating_point or tuple(tensor.shape) != shape:
        raise RequestError(f"batch.{name} must be a float tensor of shape {list(shape)}, got {tensor.dtype} {list(tensor.shape)}")
    if not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).reshape(tensor.shape[0], -1).any(-1).nonzero()[0]) if tensor.dim() else 0
        raise RequestError(f"batch.{name} has a non-finite value (sequence {bad})")
    return tensor


def finite_float(name: str, value: object) -> float:
    """A request's scalar field as a finite float, else a ``RequestError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def learning_rate(name: str, value: object) -> float | None:
    """An ``optim_step``'s learning rate: None (the schedule's), or a finite number > 0, else a ``RequestError``
    naming ``name``, before any work: a non-finite or negative rate would step the weights to non-finite or backwards."""
    if value is not None and finite_float(name, value) <= 0:
        raise RequestError(f"{name} must be > 0, got {value!r}")
    return None if value is None else float(value)


@dataclass(frozen=True)
class AdamSettings:
    """One ``optim_step``'s AdamW settings besides the learning rate (the Tinker API sends them every step).
    They stay on the optimizer's parameter groups until a later step sets others."""

    betas: tuple[float, float]  # (beta1, beta2), each in [0, 1)
    eps: float  # > 0
    weight_decay: float  # >= 0, decoupled (AdamW)
    max_grad_norm: float  # this step's clipping threshold; 0: no clipping

    def __post_init__(self) -> None:
        b1, b2 = self.betas
        problems = [f"{name}={value!r} must be in [0, 1)" for name, value in (("beta1", b1), ("beta2", b2)) if not 0 <= value < 1]
        problems += [f"eps={self.eps!r} must be > 0"] if not self.eps > 0 else []
        problems += [f"{name}={value!r} must be >= 0" for name, value in (("weight_decay", self.weight_decay),
                                                                          ("max_grad_norm", self.max_grad_norm)) if not value >= 0]
        if problems:
            raise RequestError("optim_step: " + "; ".join(problems))


def split_by_counts(values: list, counts: list[int]) -> list[list]:
    """``values`` cut into consecutive pieces of ``counts`` items (a flat wire list back into its rows)."""
    out, start = [], 0
    for count in counts:
        out.append(values[start:start + count])
        start += count
    return out
