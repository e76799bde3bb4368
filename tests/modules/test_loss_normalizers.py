"""Normalisers stay exact under gradient accumulation and data parallelism: the loss and gradient of
one batch equal the sums over its micro-batches, and over 2 real gloo ranks."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arctic_rl.modules.losses import LossNormalizer
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
