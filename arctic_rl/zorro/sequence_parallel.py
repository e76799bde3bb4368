"""Ulysses sequence parallelism for ZoRRo's packed forward: ``N`` ranks share one packed row, each holding ``T/N`` tokens.

    sp = SequenceParallel.consecutive_groups(n)  # this rank's group of N consecutive ranks (a collective)
    logprobs, entropy = zorro_response_logprobs(..., sequence_parallel=sp)

Every rank of the group packs the same samples into the same deduplicated row (``packing.py`` or
``prefix_tree.py``: a prompt computed once, its responses attending to it), padded to a multiple of ``N``,
and runs the decoder on its contiguous slice of ``T/N`` rows (embeddings, norms, MLPs and rotary
positions are per token). At each attention layer an all-to-all turns "my slice of the row, all heads"
into "the whole row, my ``H/N`` heads" (:meth:`SequenceParallel.seq_to_heads`); attention runs with the
full ZoRRo mask of the row for those heads (the backend is unchanged: ``attention.py`` wraps it); the
inverse all-to-all returns "my slice, all heads" (:meth:`SequenceParallel.heads_to_seq`). Each rank then
computes the log-probs (and entropies) of the response tokens whose predicting row it holds, and
:meth:`SequenceParallel.gather_token_values` all-gathers them, so every rank has every value and the loss
and its normalisers are those of the whole row.

Gradients: every exchange is an ``autograd.Function`` whose backward is its exact adjoint (the inverse
all-to-all; for the all-gather, the sum of every rank's gradient of its copy, then its own part). Each rank
of the group computes the same loss ``L`` from the same gathered values, so the ranks' parameter gradients
sum to ``N dL/dθ``: their mean (what data-parallel averaging over all ranks takes) is the single-rank
gradient, with no rescaling of the loss.

The exchange is ``all_to_all_single``, which NCCL and gloo (torch >= 2.x, CPU tensors) both implement;
it moves ``1/N`` of the activations per rank. Over gloo, CUDA tensors go through host memory (gloo's collectives
are for CPU tensors): several ranks can then share one GPU, which is how the GPU backends are checked on one device. Query and key/value heads are split in contiguous blocks, so
grouped-query attention keeps its grouping; the query heads must divide by ``N`` (checked up front), and where the
key/value heads do not (fewer of them than ranks), each is repeated ``lcm(Hkv, N) / Hkv`` times before the
exchange (:meth:`SequenceParallel.split_kv_heads`), so every rank receives the ones its query heads read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


class SequenceParallelError(ValueError):
    """A model or layout the sequence-parallel split cannot serve; the message names the reason."""


@dataclass(frozen=True)
class SequenceParallel:
    """The ranks that share each packed row: ``size`` of them, this one at ``rank`` within ``group``."""

    group: dist.ProcessGroup | None  # None: the default (world) group
    size: int
    rank: int

    @staticmethod
    def consecutive_groups(size: int) -> "SequenceParallel":
        """Split the world into groups of ``size`` consecutive ranks (``size`` divides it) and return this rank's. A
        collective: every rank creates every group, in the same order."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size:
            raise SequenceParallelError(f"sequence-parallel degree {size} does not divide the world of {world} ranks")
        mine = None
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine = SequenceParallel(group, size, rank - start)
        return mine

    def check_model(self, model: torch.nn.Module) -> None:
        """Each rank takes ``H/N`` query heads: ``H`` must divide by ``N``."""
        text = model.config.get_text_config()
        if text.num_attention_heads % self.size:
            raise SequenceParallelError(
                f"compute.sequence_parallel={self.size} splits attention heads over {self.size} ranks, but model type "
                f"'{model.config.model_type}' has {text.num_attention_heads} query heads: not a multiple of {self.size}"
            )

    def split_kv_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, T, D]`` with each head repeated so that the count divides by ``N`` (``lcm(Hkv, N)`` heads; the
        grouped-query mapping of query heads onto them is unchanged), or ``x`` where ``Hkv`` already does."""
        factor = self.size // math.gcd(x.shape[1], self.size)
        return x if factor == 1 else x.repeat_interleave(factor, dim=1)

    def row_multiple(self, multiple: int) -> int:
        """What a packed row is padded to: a multiple of both ``multiple`` (the backend's) and ``N``."""
        return multiple * self.size // math.gcd(multiple, self.size)

    def local_rows(self, num_tokens: int) -> slice:
        """This rank's contiguous slice of a row of ``num_tokens`` (a multiple of ``N``)."""
        if num_tokens % self.size:
            raise SequenceParallelError(f"packed row of {num_tokens} tokens does not split over {self.size} ranks")
        per_rank = num_tokens // self.size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, T/N, D]`` (my rows, all heads) -> ``[B, H/N, T, D]`` (all rows, my heads)."""
        return _AllToAll.apply(x, 1, 2, self.group, self.size)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H/N, D]`` (all rows, my heads: an attention output) -> ``[B, T/N, H, D]``."""
        return _AllToAll.apply(x, 1, 2, self.group, self.size)

    def local_heads(self, per_head: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's block of a per-head ``[H]`` tensor (attention sinks), or None."""
        if per_head is None:
            return None
        block = per_head.shape[0] // self.size
        return per_head[self.rank * block : (self.rank + 1) * block]

    def gather_token_values(self, local: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
        """Every rank's ``local [m_r, C]`` values, in the order of ``owner [M]`` (the rank holding each of the ``M``
        tokens, the same on every rank; rank ``r``'s ``m_r`` values are its tokens in order) -> ``[M, C]``."""
        counts = torch.bincount(owner, minlength=self.size).tolist()
        if local.shape[0] != counts[self.rank]:
            raise SequenceParallelError(f"rank {self.rank} holds {local.shape[0]} values, its layout says {counts[self.rank]}")
        most = max(counts)
        padded = torch.nn.functional.pad(local, (0, 0, 0, most - local.shape[0]))
        gathered = _AllGather.apply(padded, self.group, self.size)  # [N, most, C]
        by_rank = torch.cat([gathered[r, : counts[r]] for r in range(self.size)])  # tokens sorted by owner, stable
        order = torch.argsort(owner, stable=True)  # position in by_rank of each token -> invert
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return by_rank.index_select(0, inverse.to(by_rank.device))


def _on_host(group, x: torch.Tensor) -> bool:
    """Whether ``x`` goes through host memory for a collective on ``group``: CUDA tensors over gloo."""
    return x.is_cuda and dist.get_backend(group) == dist.Backend.GLOO


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, size: int) -> torch.Tensor:
    """Split ``x`` into ``size`` blocks along ``scatter_dim``, send block ``i`` to rank ``i``, and concatenate the
    blocks received (in rank order) along ``gather_dim``. ``all_to_all(., gather_dim, scatter_dim)`` inverts it."""
    blocks = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    staged = blocks.cpu() if _on_host(group, blocks) else blocks
    received = torch.empty_like(staged)
    dist.all_to_all_single(received, staged, group=group)
    return torch.cat(received.to(x.device).unbind(0), dim=gather_dim)


def _all_gather(x: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    staged = x.cpu() if _on_host(group, x) else x
    out = [torch.empty_like(staged) for _ in range(size)]
    dist.all_gather(out, staged, group=group)
    return [o.to(x.device) for o in out]


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    staged = x.cpu() if _on_host(group, x) else x
    dist.all_reduce(staged, group=group)
    return staged.to(x.device)


class _AllToAll(torch.autograd.Function):
    """``all_to_all`` with its inverse as backward (the exchange is a permutation of elements across ranks)."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, size):
        ctx.dims, ctx.group, ctx.size = (scatter_dim, gather_dim), group, size
        return all_to_all(x, scatter_dim, gather_dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(grad, gather_dim, scatter_dim, ctx.group, ctx.size), None, None, None, None


class _AllGather(torch.autograd.Function):
    """``[m, C]`` -> ``[N, m, C]``, every rank's block. Backward: each rank's gradient of its copy, summed over the
    ranks (an all-reduce, which gloo has where it lacks reduce-scatter), then this rank's block."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        return torch.stack(_all_gather(x.contiguous(), group, size))

    @staticmethod
    def backward(ctx, grad):
        grad = _all_reduce(grad.contiguous(), ctx.group)
        return grad[ctx.rank], None, None
