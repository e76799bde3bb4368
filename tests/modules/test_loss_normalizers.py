"""Normalisers stay exact under gradient accumulation and data parallelism: the loss and gradient of
one batch equal the sums over its micro-batches, and over 2 real gloo ranks."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arctic_rl.modules.corrections import PolicyWeights, off_policy_sequence_mask, sampler_importance_weights
from arctic_rl.modules.losses import LossConfig, LossNormalizer, Regularizers, grpo_family_loss
from arctic_rl.loss_registry import get_loss
from arctic_rl.modules.token_selection import entropy_threshold, high_entropy_mask
from arctic_rl.weight_sync.broadcast import free_port
from tests.modules.dist_loss_worker import make_batch, rows_loss

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


def full_and_pieces(loss_type, pieces):
    w0, *_, mask, _ = make_batch()
    normalizer = LossNormalizer.of(mask, max_response_length=6)
    w = w0.clone().requires_grad_(True)
    full = rows_loss(loss_type, w, slice(None), normalizer)
    full.backward()
    total_loss, total_grad = 0.0, torch.zeros_like(w0)
    for rows in pieces:
        wp = w0.clone().requires_grad_(True)
        loss = rows_loss(loss_type, wp, rows, normalizer)
        loss.backward()
        total_loss, total_grad = total_loss + loss.item(), total_grad + wp.grad
    return full.item(), w.grad, total_loss, total_grad


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_reproduce_the_full_batch(loss_type):
    full, full_grad, loss, grad = full_and_pieces(loss_type, [slice(0, 3), slice(3, 4), slice(4, 8)])  # uneven pieces
    assert loss == pytest.approx(full, abs=1e-12)
    torch.testing.assert_close(grad, full_grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "luspo"])
def test_two_gloo_ranks_reproduce_the_full_batch(loss_type, tmp_path):
    worker, out, port = Path(__file__).with_name("dist_loss_worker.py"), tmp_path / "result.pt", str(free_port())
    repo = str(Path(__file__).resolve().parents[2])
    procs = [
        subprocess.Popen([sys.executable, str(worker), str(rank), "2", port, loss_type, str(out)], env={"PYTHONPATH": repo, "PATH": ""})
        for rank in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    result = torch.load(out)
    full, full_grad, _, _ = full_and_pieces(loss_type, [])
    assert result[0].item() == pytest.approx(full, abs=1e-12)
    torch.testing.assert_close(result[1:].view_as(full_grad), full_grad, atol=1e-12, rtol=0)


def corrected_rows_loss(w: torch.Tensor, rows: slice, normalizer: LossNormalizer, threshold: float) -> torch.Tensor:
    """dapo with every loss-side option on: the mismatch correction, off-policy masking, the entropy
    selection (a threshold of the whole batch) and its entropy bonus."""
    _, x, y, old, mask, adv = make_batch()
    logits = w + x[rows]
    logprobs = torch.log_softmax(logits, -1).gather(-1, y[rows][..., None])[..., 0]
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    sampler = (old + 0.1 * torch.sin(torch.arange(old.numel(), dtype=old.dtype)).view_as(old))[rows]
    m = mask[rows]
    weights = PolicyWeights(importance=sampler_importance_weights(old[rows], sampler, m, "sequence_truncate", 0.5, 2.0),
                            off_policy=off_policy_sequence_mask(adv[rows], logprobs, sampler, m, 0.05),
                            entropy=high_entropy_mask(entropy, m, threshold))
    loss, _ = grpo_family_loss(LossConfig(loss_type="dapo"), get_loss("dapo").aggregation, Regularizers(entropy_coef=0.01),
                               logprobs, old[rows], adv[rows], m, normalizer, entropy=entropy, weights=weights)
    return loss


def test_loss_side_options_keep_micro_batches_exact():
    """Per-sequence factors and a whole-batch entropy threshold and count: the pieces sum to the batch."""
    w0, x, _, _, mask, _ = make_batch()
    entropy = -(torch.softmax(w0 + x, -1) * torch.log_softmax(w0 + x, -1)).sum(-1)
    threshold = entropy_threshold(entropy, mask, 0.3)
    selected = high_entropy_mask(entropy, mask, threshold).sum().item()
    normalizer = LossNormalizer(mask.sum().item(), float(mask.shape[0]), 6, num_selected_tokens=selected)
    w = w0.clone().requires_grad_(True)
    full = corrected_rows_loss(w, slice(None), normalizer, threshold)
    full.backward()
    total, grad = 0.0, torch.zeros_like(w0)
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        wp = w0.clone().requires_grad_(True)
        loss = corrected_rows_loss(wp, rows, normalizer, threshold)
        loss.backward()
        total, grad = total + loss.item(), grad + wp.grad
    assert total == pytest.approx(full.item(), abs=1e-12) and full.item() != 0.0
    torch.testing.assert_close(grad, w.grad, atol=1e-12, rtol=0)


def test_entropy_threshold_over_two_gloo_ranks_is_the_whole_batch_threshold(tmp_path):
    worker, out, port = Path(__file__).with_name("dist_loss_worker.py"), tmp_path / "result.pt", str(free_port())
    repo = str(Path(__file__).resolve().parents[2])
    procs = [subprocess.Popen([sys.executable, str(worker), str(rank), "2", port, "entropy_threshold", str(out)],
                              env={"PYTHONPATH": repo, "PATH": ""}) for rank in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    _, _, _, old, mask, _ = make_batch()
    assert torch.load(out).item() == pytest.approx(entropy_threshold(-old, mask, 0.3), abs=1e-15)
