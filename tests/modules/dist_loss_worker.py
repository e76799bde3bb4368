"""Worker for test_loss_normalizers: one gloo rank computing its half of a batch's loss and gradient.

Usage: python dist_loss_worker.py RANK WORLD PORT LOSS_TYPE OUT_FILE
(LOSS_TYPE ``entropy_threshold``: the top_entropy_quantile threshold of the rank's half over both ranks.)
"""

import sys

import torch
import torch.distributed as dist

from arctic_rl.modules.losses import LossConfig, LossNormalizer, aggregate_loss, policy_objective
from arctic_rl.loss_registry import get_loss


def make_batch(n: int = 8, t: int = 6, v: int = 5):
    """A shared parameter W [T, V] and per-row inputs: logprobs[i, t] = log_softmax(W[t] + x[i, t])[y[i, t]]."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(t, v, generator=g, dtype=torch.float64)
    x = torch.randn(n, t, v, generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (n, t), generator=g)
    old = torch.log_softmax(w + x + 0.3 * torch.randn(n, t, v, generator=g, dtype=torch.float64), -1).gather(-1, y[..., None])[..., 0]
    lengths = torch.tensor([6, 2, 5, 1, 3, 6, 4, 2])
    mask = (torch.arange(t)[None] < lengths[:, None]).double()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return w, x, y, old, mask, adv


def rows_loss(loss_type: str, w: torch.Tensor, rows: slice, normalizer: LossNormalizer) -> torch.Tensor:
    _, x, y, old, mask, adv = make_batch()
    logprobs = torch.log_softmax(w + x[rows], -1).gather(-1, y[rows][..., None])[..., 0]
    terms = policy_objective(LossConfig(loss_type=loss_type), logprobs, old[rows], adv[rows], mask[rows])
    return aggregate_loss(terms.per_token, mask[rows], get_loss(loss_type).aggregation, normalizer)


if __name__ == "__main__":
    rank, world, port, loss_type, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    w0, *_, mask, _ = make_batch()
    half = mask.shape[0] // world
    rows = slice(rank * half, (rank + 1) * half)
    if loss_type == "entropy_threshold":
        from arctic_rl.modules.token_selection import entropy_threshold

        entropy = -make_batch()[3]  # any positive per-token values; ranks hold unequal token counts
        found = entropy_threshold(entropy[rows], mask[rows], 0.3, all_ranks=True)
        if rank == 0:
            torch.save(torch.tensor([found], dtype=torch.float64), out)
        dist.destroy_process_group()
        sys.exit(0)
    normalizer = LossNormalizer.of(mask[rows], max_response_length=6, all_ranks=True)
    w = w0.clone().requires_grad_(True)
    loss = rows_loss(loss_type, w, rows, normalizer)
    loss.backward()
    result = torch.cat([loss.detach().reshape(1), w.grad.flatten()])
    dist.all_reduce(result)  # what a data-parallel strategy does (its averaging undone by x world_size)
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()
