"""Masks with holes (multi-turn: the environment's tokens inside a response): the trainer's log-probs of the
generated tokens equal the model's own forward over the whole sequence, the environment's tokens read 0, and every
loss over a batch with holes equals the same loss over the generated tokens alone, laid out as a plain prefix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from arctic_rl.modules.losses import GRPO_FAMILY, LossConfig, LossNormalizer, Regularizers, grpo_family_loss
from arctic_rl.loss_registry import get_loss
from arctic_rl.modules.micro_batches import micro_batch_rows
from arctic_rl.modules.models import build_causal_lm
from arctic_rl.modules.training_core import TrainingCore
from arctic_rl.rollout.batch import RolloutBatch

# per row: (prompt, response, 1 = generated / 0 = observation); rows right-padded to R = 9
ROWS = [
    ([3, 9, 14], [20, 21, 5, 6, 7, 22, 23], [1, 1, 0, 0, 0, 1, 1]),
    ([3, 9, 14], [24, 5, 6, 7, 25, 5, 6, 7, 26], [1, 0, 0, 0, 1, 0, 0, 0, 1]),
    ([11, 12], [27, 28, 29], [1, 1, 1]),
]


def batch_with_holes(pad: int = 0) -> RolloutBatch:
    r = max(len(resp) for _, resp, _ in ROWS)
    ids, gen, obs = torch.full((len(ROWS), r), pad), torch.zeros(len(ROWS), r), torch.zeros(len(ROWS), r)
    for i, (_, resp, mask) in enumerate(ROWS):
        ids[i, : len(resp)] = torch.tensor(resp)
        gen[i, : len(resp)] = torch.tensor(mask, dtype=torch.float32)
        obs[i, : len(resp)] = 1.0 - gen[i, : len(resp)]
    n = len(ROWS)
    return RolloutBatch(prompt_token_ids=[p for p, _, _ in ROWS], response_ids=ids, response_mask=gen,
                        sampler_logprobs=torch.zeros(n, r), rewards=torch.zeros(n), advantages=torch.tensor([1.0, -0.5, 0.25]),
                        group_size=1, observation_mask=obs)


class Core(TrainingCore):
    """The training core's log-prob path with only what it reads of a GRPOModule."""

    def __init__(self, zorro: bool, dedup: str = "group") -> None:
        self.options = SimpleNamespace(sampling=SimpleNamespace(temperature=1.0),
                                       compute=SimpleNamespace(zorro=zorro, attention_backend="sdpa", zorro_dedup=dedup,
                                                               sequence_parallel=1),
                                       corrections=SimpleNamespace(router_replay=False))
        self.tokenizer = SimpleNamespace(pad_token_id=0)


@pytest.mark.parametrize(("zorro", "dedup"), [(True, "group"), (True, "tree"), (False, "group")])
def test_logprobs_with_holes_equal_the_models_own_forward_on_generated_tokens(tiny_model_dir, zorro, dedup):
    model = build_causal_lm(str(tiny_model_dir), "float32").eval()
    batch = batch_with_holes()
    with torch.no_grad():
        logprobs, entropy = Core(zorro, dedup).sequence_logprobs(model, batch, with_entropy=True)
        for i, (prompt, resp, mask) in enumerate(ROWS):
            full = torch.tensor([prompt + resp])
            own = torch.log_softmax(model(input_ids=full).logits[0, len(prompt) - 1: -1].double(), -1)
            expected = own.gather(-1, full[0, len(prompt):, None]).squeeze(-1) * torch.tensor(mask)
            torch.testing.assert_close(logprobs[i, : len(resp)].double(), expected, rtol=0, atol=1e-5)
            assert torch.all(logprobs[i, len(resp):] == 0) and torch.all(entropy[i][batch.observation_mask[i].bool()] == 0)


def test_sequence_mask_is_a_prefix_and_packing_reads_full_lengths():
    batch = batch_with_holes()
    assert batch.sequence_mask.sum(-1).tolist() == [7.0, 9.0, 3.0] and batch.response_mask.sum(-1).tolist() == [4.0, 3.0, 3.0]
    # a token budget packs by every response token (ZoRRo processes the environment's too): 3 + 7 + 9 + 2 + 3 = 24
    assert sorted(i for m in micro_batch_rows(batch, None, 24) for i in m) == [0, 1, 2] and len(micro_batch_rows(batch, None, 24)) == 1
    assert len(micro_batch_rows(batch, None, 23)) > 1  # generated tokens alone (3 + 4 + 3 + 2 + 3 = 15) would fit
    assert RolloutBatch.concat([batch, batch.select(slice(0, 1))]).observation_mask.shape == (4, 9)
    assert torch.equal(batch.take([2, 0]).observation_mask, batch.observation_mask[[2, 0]])


def compacted(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's values at ``mask`` moved to the front (a prefix layout with the holes taken out), zero after."""
    out = torch.zeros_like(values)
    for i in range(values.shape[0]):
        kept = values[i][mask[i].bool()]
        out[i, : kept.numel()] = kept
    return out


@pytest.mark.parametrize("loss_type", sorted(GRPO_FAMILY))
def test_every_loss_over_holes_equals_the_loss_over_the_generated_tokens_alone(loss_type):
    torch.manual_seed(0)
    batch = batch_with_holes()
    mask = batch.response_mask
    logprobs = (torch.randn(mask.shape) * 0.3 - 1.0).requires_grad_()
    old = logprobs.detach() + torch.randn(mask.shape) * 0.2
    ref = logprobs.detach() + torch.randn(mask.shape) * 0.1
    entropy = torch.rand(mask.shape)
    level = "sequence" if loss_type == "luspo" else "token"  # luspo is defined at the sequence level
    cfg, regs = LossConfig(loss_type=loss_type, importance_sampling_level=level), Regularizers(kl_coef=0.05, entropy_coef=0.01)
    args = (batch.advantages,)

    def loss_of(lp, o, r, e, m):
        normalizer = LossNormalizer.of(m, 9)
        return grpo_family_loss(cfg, get_loss(loss_type).aggregation, regs, lp, o, *args, m, normalizer, r, e, None)[0]

    holes = loss_of(logprobs, old, ref, entropy, mask)
    prefix_lp = compacted(logprobs.detach(), mask).requires_grad_()
    prefix = loss_of(prefix_lp, compacted(old, mask), compacted(ref, mask), compacted(entropy, mask), compacted(mask, mask))
    torch.testing.assert_close(holes, prefix, rtol=1e-6, atol=1e-7)
    holes.backward()
    prefix.backward()
    assert torch.all(logprobs.grad[batch.observation_mask.bool()] == 0)  # no gradient reaches the environment's tokens
    torch.testing.assert_close(compacted(logprobs.grad, mask), prefix_lp.grad, rtol=1e-6, atol=1e-7)


def test_dapo_loss_with_holes_by_hand():
    batch = batch_with_holes()
    mask = batch.response_mask
    logprobs = torch.linspace(-2.0, -0.5, mask.numel()).view(mask.shape)
    old = logprobs - 0.1 * torch.arange(mask.numel()).view(mask.shape) % 0.5
    cfg = LossConfig(loss_type="dapo")
    loss, _ = grpo_family_loss(cfg, "token_mean", Regularizers(), logprobs, old, batch.advantages, mask, LossNormalizer.of(mask, 9))
    total, count = 0.0, 0
    for i in range(mask.shape[0]):
        a = batch.advantages[i].item()
        for t in range(mask.shape[1]):
            if mask[i, t]:
                ratio = torch.exp(logprobs[i, t] - old[i, t]).item()
                total += -min(ratio * a, min(max(ratio, 1 - cfg.clip_low), 1 + cfg.clip_high) * a)
                count += 1
    assert count == 10 and loss.item() == pytest.approx(total / count, rel=1e-5)
