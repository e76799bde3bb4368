"""The pure parts of the SkyRL adapter: Tinker datums to arctic-rl sequences (hand-checked splits and
every refusal), and the ``tinker.*`` losses against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from arctic_rl.serve.tinker.batch import (Datum, TinkerInputError, forward_batch, target_logprobs, target_sources, train_batch,
                                         train_sequence)
from arctic_rl.serve.tinker.losses import cispo, cross_entropy, datum_loss, dro, importance_sampling, ppo
from arctic_rl.modules.losses import LossNormalizer
from arctic_rl.serve.errors import RequestError
from arctic_rl.serve.registry import LossInputs, get_loss


def rl_datum(prompt, completion, advantage, sampler=None, weights=True) -> Datum:
    full, p = prompt + completion, len(prompt) - 1
    return Datum(tokens=full[:-1], targets=full[1:], weights=[0.0] * p + [1.0] * len(completion) if weights else [1.0] * (len(full) - 1),
                 advantages=[0.0] * p + [advantage] * len(completion), logprobs=[0.0] * p + (sampler or [-1.0] * len(completion)))


@pytest.mark.parametrize("weights", [True, False])  # Tinker's weights given, or defaulted to ones by SkyRL
def test_rl_datum_splits_at_the_prompt(weights):
    d = rl_datum([5, 6, 7], [8, 9], 0.5, sampler=[-0.1, -0.2], weights=weights)
    assert train_sequence(0, d, "importance_sampling") == ([5, 6, 7], [8, 9], [0.5, 0.5], [-0.1, -0.2], [1, 1])


def test_zero_advantage_datum_is_kept_with_nothing_to_train():
    d = rl_datum([5, 6, 7], [8, 9], 0.0)
    prompt, response, advantages, _, _ = train_sequence(3, d, "ppo")
    assert (prompt, response, advantages) == ([5, 6, 7, 8], [9], [0.0])


def test_cross_entropy_trains_the_weighted_span_with_its_weights_as_advantages():
    d = Datum(tokens=[1, 2, 3, 4], targets=[2, 3, 4, 5], weights=[0, 1, 0.5, 0], advantages=[], logprobs=[])
    assert train_sequence(0, d, "cross_entropy")[:3] == ([1, 2], [3, 4], [1.0, 0.5])


def test_advantages_go_per_token_with_the_weights_folded_in():
    """Advantages that vary over a response (a KL penalty per token) and fractional weights: both exact."""
    d = Datum(tokens=[5, 6, 7, 8], targets=[6, 7, 8, 9], weights=[0, 1, 0.5, 1], advantages=[0, 1, 2, -1], logprobs=[0, -1, -1, -1])
    assert train_sequence(0, d, "importance_sampling")[2] == [1.0, 1.0, -1.0]
    assert train_sequence(0, d, "ppo")[2] == [1.0, 1.0, -1.0]


def test_dro_keeps_every_weighted_target_and_refuses_fractional_weights():
    """dro's penalty counts where the advantage is 0, so a zero-advantage target stays in the span."""
    d = Datum(tokens=[5, 6, 7, 8], targets=[6, 7, 8, 9], weights=[1, 1, 1, 1], advantages=[0, 0, 2, 2], logprobs=[-1, -1, -1, -1])
    assert train_sequence(0, d, "dro") == ([5], [6, 7, 8, 9], [0, 0, 2, 2], [-1, -1, -1, -1], [1, 1, 1, 1])
    d.weights = [0, 1, 0.5, 1]
    with pytest.raises(TinkerInputError, match=r"weights\[2\] = 0.5; dro takes weights 0 and 1"):
        train_sequence(0, d, "dro")


def test_train_batch_keeps_order_and_pads():
    batch = train_batch([rl_datum([5, 6], [8, 9, 10], 1.0), rl_datum([5, 6], [8], -1.0)], "importance_sampling")
    assert batch.prompt_token_ids == [[5, 6], [5, 6]]
    assert batch.response_ids.tolist() == [[8, 9, 10], [8, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.advantages.tolist() == [[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]]


def test_multi_turn_datum_trains_around_its_observation():
    """Weight 0 inside the span (a tool's observation between two turns): a hole in the loss mask, and the
    observation's tokens stay in the response as inputs."""
    d = Datum(tokens=[5, 6, 7, 8, 9, 10], targets=[6, 7, 8, 9, 10, 11], weights=[0, 1, 0, 0, 1, 1],
              advantages=[0, 2, 0, 0, 2, 2], logprobs=[0, -1, 0, 0, -2, -3])
    assert train_sequence(0, d, "importance_sampling") == ([5, 6], [7, 8, 9, 10, 11], [2, 0, 0, 2, 2], [-1, 0, 0, -2, -3], [1, 0, 0, 1, 1])
    batch = train_batch([d], "importance_sampling")
    assert batch.response_ids.tolist() == [[7, 8, 9, 10, 11]] and batch.response_mask.tolist() == [[1, 0, 0, 1, 1]]


def test_target_sources_rerun_only_what_the_loss_forward_did_not_answer():
    """A trained span without holes that reaches the last target comes from the loss's own forward, its prompt's
    targets from one no-grad forward per distinct prompt; a span with a hole, or with targets after it, is run whole."""
    group = [rl_datum([5, 6, 7], [8, 9], a) for a in (1.0, -1.0)]  # a GRPO group: one prompt, two responses
    hole = Datum(tokens=[5, 6, 7, 8, 9, 10], targets=[6, 7, 8, 9, 10, 11], weights=[0, 1, 0, 0, 1, 1],
                 advantages=[0, 2, 0, 0, 2, 2], logprobs=[0, -1, 0, 0, -2, -3])
    tail = Datum(tokens=[5, 6, 7, 8], targets=[6, 7, 8, 9], weights=[0, 1, 1, 0], advantages=[0, 1, 1, 0], logprobs=[0, -1, -1, 0])
    whole = Datum(tokens=[3, 4], targets=[4, 5], weights=[1, 1], advantages=[1, 1], logprobs=[-1, -1])
    datums = [*group, hole, tail, whole]
    batch = train_batch(datums, "importance_sampling")
    rest, plan = target_sources(datums, batch)
    assert plan == [(0, 2), (0, 2), (1, 6), (2, 4), (-1, 0)]
    assert rest.prompt_token_ids == [[5], [5], [5]]
    assert [row[: int(m.sum())] for row, m in zip(rest.response_ids.tolist(), rest.response_mask)] == [
        [6, 7], [6, 7, 8, 9, 10, 11], [6, 7, 8, 9]]


def test_forward_batch_covers_every_target():
    batch = forward_batch([rl_datum([5, 6], [8, 9], 1.0)])
    assert batch.prompt_token_ids == [[5]] and batch.response_ids.tolist() == [[6, 8, 9]]


@pytest.mark.parametrize(("change", "loss_fn", "message"), [
    (dict(targets=[6, 7, 9, 9]), "importance_sampling", r"datum 0: target_tokens\[2\] != model_input\[3\]"),
    (dict(weights=[0, -0.5, 1, 1]), "importance_sampling", r"weights\[1\] = -0.5; weights must be >= 0"),
    (dict(advantages=[]), "ppo", r"loss_fn 'ppo' needs loss_fn_inputs.advantages"),
    (dict(weights=[0, 1]), "importance_sampling", r"loss_fn_inputs.weights has 2 entries for 4 model_input tokens"),
    ({}, "gspo", r"loss_fn 'gspo' is not supported by arctic-rl"),
])
def test_refusals_name_the_datum_and_field(change, loss_fn, message):
    d = Datum(tokens=[5, 6, 7, 8], targets=[6, 7, 8, 9], weights=[0, 1, 1, 1], advantages=[0, 1, 1, 1], logprobs=[0, -1, -1, -1])
    for key, value in change.items():
        setattr(d, key, value)
    with pytest.raises(TinkerInputError, match=message):
        train_sequence(0, d, loss_fn)


def test_train_batch_names_the_first_bad_datum_as_datum_by_datum_checks_do():
    """The request's value ranges are checked at once; when one is out of range the first bad datum is still the
    one named, whatever it breaks (its layout before a later datum's value)."""
    good = rl_datum([5, 6], [7, 8], 1.0)
    shifted = Datum(tokens=[5, 6, 7], targets=[6, 9, 8], weights=[1, 1, 1], advantages=[0, 1, 1], logprobs=[0, -1, -1])
    nan = rl_datum([5, 6], [7, 8], float("nan"))
    with pytest.raises(TinkerInputError, match=r"datum 1: target_tokens\[1\] != model_input\[2\]"):
        train_batch([good, shifted, nan], "importance_sampling")
    with pytest.raises(TinkerInputError, match=r"datum 1: loss_fn_inputs.advantages\[1\] = nan"):
        train_batch([good, nan, shifted], "importance_sampling")
    positive = rl_datum([5, 6], [7, 8], 1.0, sampler=[-1.0, 0.5])
    with pytest.raises(TinkerInputError, match=r"datum 2: loss_fn_inputs.logprobs\[2\] = 0.5"):
        train_batch([good, good, positive], "importance_sampling")


def test_target_logprobs_join_both_forwards_datum_by_datum():
    """Per plan entry ``(row, k)``: the no-grad forward's row up to k, then the datum's own trained values."""
    trained = torch.tensor([[10.0, 11.0, 12.0], [20.0, 21.0, 0.0], [30.0, 31.0, 32.0]])
    before = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-5.0, -6.0, 0.0, 0.0]])
    got = target_logprobs(trained, before, [(0, 2), (1, 2), (-1, 0)], [5, 4, 3])
    assert got.dtype == np.float32 and got.tolist() == [-1, -2, 10, 11, 12, -5, -6, 20, 21, 30, 31, 32]
    assert target_logprobs(trained, None, [(-1, 0), (-1, 0)], [3, 1]).tolist() == [10, 11, 12, 20]


def inputs(logprobs, sampler, advantages, mask) -> LossInputs:
    mask = torch.tensor(mask)
    return LossInputs(logprobs=torch.tensor(logprobs), old_logprobs=torch.tensor(logprobs), advantages=torch.tensor(advantages),
                      mask=mask, normalizer=LossNormalizer.of(mask, 2), sampler_logprobs=torch.tensor(sampler))


def test_losses_are_tinkers_token_sums():
    x = inputs([[-1.0, -2.0], [-0.5, -3.0]], [[-1.5, -2.0], [-0.5, -1.0]], [2.0, -1.0], [[1.0, 1.0], [1.0, 0.0]])
    r = [[math.exp(0.5), 1.0], [1.0, math.exp(-2.0)]]
    assert importance_sampling(x, {})[0].item() == pytest.approx(-(r[0][0] * 2 + 2) + 1.0)
    # ppo: A=2 row clips exp(0.5)=1.65 to 1.2; A=-1 row: min(-1, -1) = -1
    assert ppo(x, {})[0].item() == pytest.approx(-(1.2 * 2 + 2) + 1.0)
    assert ppo(x, {"clip_high_threshold": 2.0})[0].item() == pytest.approx(-(r[0][0] * 2 + 2) + 1.0)
    # cispo: -sg(clip(r)) * logprob * A
    assert cispo(x, {})[0].item() == pytest.approx(-(1.2 * -1.0 * 2 + 1.0 * -2.0 * 2) - (1.0 * -0.5 * -1.0))
    assert cross_entropy(x, {})[0].item() == pytest.approx(-(-1.0 * 2 - 2.0 * 2) - 0.5)


def test_losses_are_registered_and_check_their_config():
    assert get_loss("tinker.importance_sampling").fn is importance_sampling
    x = inputs([[-1.0]], [[-1.0]], [1.0], [[1.0]])
    with pytest.raises(RequestError, match="takes no config"):
        importance_sampling(x, {"clip_low_threshold": 0.5})
    with pytest.raises(RequestError, match="unknown config keys"):
        ppo(x, {"value_clip": 0.5})


def test_dro_is_tinkers_sum_with_its_quadratic_penalty():
    """``-(logprobs * A - beta / 2 * (logprobs - sampler)**2)`` per token, by hand; ``beta`` is required."""
    x = inputs([[-1.0, -2.0]], [[-1.5, -2.0]], [[2.0, 0.0]], [[1.0, 1.0]])
    assert dro(x, {"beta": 0.1})[0].item() == pytest.approx(-(-1.0 * 2 - 0.05 * 0.25) - (0.0 - 0.0))
    with pytest.raises(RequestError, match="needs loss_fn_config beta"):
        dro(x, {})


@pytest.mark.parametrize(("loss_fn", "config"), [("importance_sampling", {}), ("ppo", {}), ("cispo", {}),
                                                 ("dro", {"beta": 0.3}), ("cross_entropy", {})])
def test_served_loss_equals_the_datum_definition(loss_fn, config):
    """The loss arctic-rl trains on (a datum's span, advantages per token, weights folded in) equals Tinker's
    definition over every target of the datum (``datum_loss``, what ``forward`` reports)."""
    d = Datum(tokens=[5, 6, 7, 8, 9], targets=[6, 7, 8, 9, 10], weights=[0, 1, 0.5 if loss_fn != "dro" else 1, 1, 0],
              advantages=[0, 1.5, -2, 0.5, 3], logprobs=[-0.2, -1.1, -0.9, -1.3, -0.4])
    logprobs = [-0.3, -1.0, -1.2, -1.25, -0.5]  # the model's, one per target
    prompt, response, adv, sampler, mask = train_sequence(0, d, loss_fn)
    start = len(prompt) - 1
    mask_t = torch.tensor([mask], dtype=torch.float32)
    x = LossInputs(logprobs=torch.tensor([logprobs[start:start + len(response)]]), old_logprobs=torch.zeros(1, len(response)),
                   advantages=torch.tensor([adv]), mask=mask_t, normalizer=LossNormalizer.of(mask_t, 8),
                   sampler_logprobs=torch.tensor([sampler]))
    served = get_loss("tinker." + loss_fn).fn(x, config)[0].item()
    assert served == pytest.approx(datum_loss(loss_fn, logprobs, d, config), rel=1e-6, abs=1e-6)


def test_per_token_advantages_cross_the_wire():
    """A ``TrainBatch`` with ``[N, R]`` advantages survives its message; a wrong width is refused by name."""
    batch = train_batch([rl_datum([5, 6], [8, 9, 10], 1.0), rl_datum([5, 6], [8], -1.0)], "importance_sampling")
    again = type(batch).from_message(batch.to_message())
    assert torch.equal(again.advantages, batch.advantages) and again.advantages.shape == (2, 3)
    message = batch.to_message()
    message.tensors["advantages"] = torch.zeros(2, 2)
    with pytest.raises(RequestError, match=r"batch.advantages must be a float tensor of shape \[2, 3\]"):
        type(batch).from_message(message)
