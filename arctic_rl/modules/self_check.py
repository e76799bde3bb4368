"""The start-up self-check: before the first optimizer step, the trainer's fast log-prob paths must
agree with the model's own per-sequence forward on a small probe cut from the real first batch.

    report = run_self_check(model, probe_of(rollout), paths, temperature=1.0, pad_token_id=0)

``probe_of`` takes the first two prompt groups of the rollout batch (two samples each, prompts and
responses truncated), so every rank builds a probe of the same shape (ZeRO-3's gathers are
collectives: every rank must run as many forwards). ``run_self_check`` computes the probe's response
log-probs and entropies with each fast path (ZoRRo on the configured backend, the naive padded batch)
and with ``model(ids).logits`` one unpadded sequence at a time (log-softmax at the temperature), all
in the run's dtype and without gradients, and raises :class:`SelfCheckFailed` when a path is off by
more than the dtype's tolerance, naming the model type, the gap and the way out. It guards every
family nobody listed: a head, mask or forward arctic-rl does not reproduce stops the run before it
trains on wrong log-probs.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from arctic_rl.rollout.batch import RolloutBatch
from arctic_rl.zorro.head_spec import UnsupportedLogitTransform

# (largest |gap| on one token, mean |gap| over the probe's tokens), in nats, by the run's dtype: float
# rounding of a different but exact computation stays far below; a wrong head or mask does not
TOLERANCE = {
    torch.float64: (1e-6, 1e-7),
    torch.float32: (1e-3, 1e-4),
    torch.float16: (0.5, 0.02),
    torch.bfloat16: (1.0, 0.05),  # per-token bf16 noise can be large (MoE routing flips); the mean is the test
}
LogprobPath = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # response_logprobs' signature


class SelfCheckFailed(RuntimeError):
    """A fast log-prob path disagrees with the model's own forward beyond the dtype's tolerance."""


@dataclass(frozen=True)
class SelfCheckReport:
    """What the self-check measured: per path, the largest and mean |gap| to the model's own forward."""

    model_type: str
    dtype: torch.dtype
    max_gap: dict[str, float]  # path name -> largest |difference| of a log-prob or entropy (nats)
    mean_gap: dict[str, float]  # path name -> mean |difference| over the probe's tokens
    sequences: int
    tokens: int
    seconds: float

    def as_metrics(self, prefix: str = "self_check/") -> dict[str, float]:
        metrics = {f"{prefix}seconds": self.seconds}
        metrics.update({f"{prefix}max_gap/{name}": gap for name, gap in self.max_gap.items()})
        return metrics

    def summary(self) -> str:
        gaps = ", ".join(f"{name} {gap:.2g}" for name, gap in self.max_gap.items())
        return (
            f"arctic-rl self-check: model type '{self.model_type}' ({_dtype_name(self.dtype)}), {self.sequences} "
            f"sequences / {self.tokens} response tokens against the model's own forward: largest gap {gaps} "
            f"(tolerance {TOLERANCE[self.dtype][0]:g}) in {self.seconds:.2f} s"
        )


def probe_of(rollout: RolloutBatch, groups: int = 2, per_group: int = 2, prompt_tokens: int = 64,
             response_tokens: int = 32) -> RolloutBatch:
    """The first ``groups`` prompt groups (contiguous runs of ``group_size``), ``per_group`` samples
    each, prompts cut to their first ``prompt_tokens`` and responses to ``response_tokens``."""
    g = rollout.group_size
    rows = [k * g + i for k in range(min(groups, rollout.num_sequences // g)) for i in range(min(per_group, g))]
    probe = rollout.take(rows)
    return replace(
        probe, prompt_token_ids=[p[:prompt_tokens] for p in probe.prompt_token_ids],
        response_ids=probe.response_ids[:, :response_tokens], response_mask=probe.response_mask[:, :response_tokens],
        observation_mask=None if probe.observation_mask is None else probe.observation_mask[:, :response_tokens],
    )


def fast_paths(zorro: bool, attention_backend: str, dedup: str = "group") -> dict[str, LogprobPath]:
    """The trainer's log-prob paths to check: the naive batch, and ZoRRo on its backend (and ``dedup``
    packing: ``group`` or ``tree``) when on."""
    from arctic_rl.modules.models import response_logprobs

    paths: dict[str, LogprobPath] = {"naive": response_logprobs}
    if zorro:
        from arctic_rl.zorro import zorro_response_logprobs

        name = f"zorro_{attention_backend}" + ("_tree" if dedup == "tree" else "")
        paths[name] = functools.partial(zorro_response_logprobs, attention_backend=attention_backend, dedup=dedup)
    return paths


def check_first_batch(model: torch.nn.Module, rollout: RolloutBatch, zorro: bool, attention_backend: str,
                      temperature: float, pad_token_id: int, dedup: str = "group") -> SelfCheckReport:
    """The self-check as the trainer runs it on its first batch: probe, check, one log line."""
    paths = fast_paths(zorro, attention_backend, dedup)
    report = run_self_check(model, probe_of(rollout), paths, temperature, pad_token_id)
    rank_zero_info(report.summary())
    return report


def run_self_check(
    model: torch.nn.Module,
    probe: RolloutBatch,
    paths: dict[str, LogprobPath],
    temperature: float,
    pad_token_id: int,
) -> SelfCheckReport:
    """Compare each of ``paths`` (``name -> fn(model, prompts, ids, mask, T, with_entropy, pad)``)
    with the model's own forward on ``probe``; raise :class:`SelfCheckFailed` beyond tolerance."""
    started = time.perf_counter()
    dtype = next(model.parameters()).dtype
    mask = probe.sequence_mask.bool()  # every token the forward reads (multi-turn: the environment's too)
    args = (probe.prompt_token_ids, probe.response_ids, probe.sequence_mask, temperature, True, pad_token_id)
    was_training = model.training
    model.eval()  # no dropout: every path sees the same function
    try:
        with torch.no_grad():
            ref_lp, ref_ent = own_forward_logprobs(model, probe, temperature)
            max_gap, mean_gap = {}, {}
            for name, path in paths.items():
                lp, ent = _run_path(model, name, path, args)
                gap = torch.cat([(lp.double() - ref_lp)[mask], (ent.double() - ref_ent)[mask]]).abs()
                max_gap[name] = gap.max().item() if gap.numel() else 0.0
                mean_gap[name] = gap.mean().item() if gap.numel() else 0.0
    finally:
        model.train(was_training)
    report = SelfCheckReport(model.config.model_type, dtype, max_gap, mean_gap, probe.num_sequences,
                             int(mask.sum()), time.perf_counter() - started)
    check_report(report, type(model).__name__)
    return report


def _run_path(model, name: str, path: LogprobPath, args: tuple):
    try:
        return path(model, *args)
    except UnsupportedLogitTransform as err:  # the measured head: no scale or cap explains the model's logits
        raise SelfCheckFailed(
            f"start-up self-check failed for model type '{model.config.model_type}' ({type(model).__name__}) on the "
            f"{name} path: {err}. Way out: none in arctic-rl for this model; its forward post-processes the logits "
            "in a way neither path reproduces (model.compute.self_check: false does not make its log-probs right)"
        ) from err


def own_forward_logprobs(model: torch.nn.Module, probe: RolloutBatch, temperature: float):
    """``log_softmax(model(prompt + response).logits / T)`` at each response token, and the entropy,
    one unpadded sequence at a time (float64 ``[N, R]``, zero past each response). One forward per
    sequence, empty responses included, so every rank runs as many (ZeRO-3)."""
    n, r = probe.response_ids.shape
    logprobs = torch.zeros(n, r, dtype=torch.float64, device=probe.response_ids.device)
    entropy = torch.zeros_like(logprobs)
    for i, prompt in enumerate(probe.prompt_token_ids):
        length = int(probe.sequence_mask[i].sum())
        ids = torch.cat([torch.tensor(prompt, device=probe.response_ids.device), probe.response_ids[i, :length]])
        logits = model(input_ids=ids[None], use_cache=False).logits[0, len(prompt) - 1 : len(prompt) - 1 + length]
        log_probs = torch.log_softmax(logits.double() / temperature, -1)
        logprobs[i, :length] = log_probs.gather(-1, ids[len(prompt) :, None]).squeeze(-1)
        entropy[i, :length] = -(log_probs.exp() * log_probs).sum(-1)
    return logprobs, entropy


def check_report(report: SelfCheckReport, model_class: str) -> None:
    """Raise :class:`SelfCheckFailed` naming the failing paths, the gap and the way out."""
    max_tol, mean_tol = TOLERANCE[report.dtype]
    failed = [n for n in report.max_gap if report.max_gap[n] > max_tol or report.mean_gap[n] > mean_tol]
    if not failed:
        return
    gaps = "; ".join(f"{n}: largest {report.max_gap[n]:.3g}, mean {report.mean_gap[n]:.3g} nats" for n in failed)
    naive_ok = "naive" in report.max_gap and "naive" not in failed
    if naive_ok:
        way_out = ("the naive per-sequence path agrees, so ZoRRo's packed layout does not reproduce this model's "
                   "attention (a mask, window, cap or sink it does not apply): set model.compute.zorro: false")
    else:
        way_out = ("the naive path disagrees too, so arctic-rl does not reproduce this model's own forward (its "
                   "forward changes the logits beyond a config-given scale or soft-cap, or its decoder differs "
                   "from forward's); it cannot be trained with exact log-probs here. model.compute.self_check: false "
                   "skips this check at your own risk")
    raise SelfCheckFailed(
        f"start-up self-check failed for model type '{report.model_type}' ({model_class}, "
        f"{_dtype_name(report.dtype)}): log-probs/entropies differ from the model's own forward ({gaps}; "
        f"tolerance {max_tol:g} largest, {mean_tol:g} mean). Way out: {way_out}"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
